//! The Python module `kvpool_native`: each part of the core registers its own classes.

use pyo3::prelude::*;

#[pymodule]
fn kvpool_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    crate::engine::py::register(m)?;
    crate::eviction::py::register(m)?;
    Ok(())
}
