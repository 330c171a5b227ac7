//! The Python module `kvpool_native`: each part of the core registers its own classes.

use pyo3::prelude::*;

#[pymodule]
fn kvpool_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The eviction policies the compiled core runs (the Python core runs any registered one).
    m.add("POLICIES", crate::eviction::registry::POLICY_NAMES.to_vec())?;
    crate::engine::py::register(m)?;
    crate::eviction::py::register(m)?;
    crate::curves::py::register(m)?;
    crate::copy::py::register(m)?;
    crate::wire::py::register(m)?;
    crate::keys::py::register(m)?;
    crate::shm::py::register(m)?;
    Ok(())
}
