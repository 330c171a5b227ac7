//! `kvpool_native.shm_put`: the same-node PUT of `ShmClient.put` (`dataplane/shm.py`) without
//! the GIL.

use pyo3::exceptions::{PyConnectionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{put, Outcome, Pool, PutError};
use crate::copy::py::buffer;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(shm_put, m)?)?;
    Ok(())
}

/// Store a chain through the agent on the blocking Unix socket `fd` (PUT_SHM as request
/// `rid` with the packed `meta`, the copy into `arena`, COMMIT as `rid + 1`). `pools` holds,
/// per pool of the reply, `(src, base, layer_stride, block_stride, piece, layers, blocks)`:
/// the contiguous `[layers, blocks, piece]` bytes of the chain's blocks `first..` and where
/// the pool's pieces lie in the arena.
///
/// Returns `("stored", stored, resident)`, `("held", resident)`, `("refused", meta)` (an
/// error reply's packed metadata, nothing stored) or `("mismatch", reason)` (the data did not
/// fit the reservation, which was aborted). OSError or ConnectionError when the exchange
/// failed: the connection is then in an unknown state.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn shm_put<'py>(
    py: Python<'py>,
    fd: i32,
    rid: u64,
    meta: &[u8],
    first: u64,
    arena: &Bound<'py, PyAny>,
    pools: Vec<(Bound<'py, PyAny>, usize, usize, usize, usize, usize, usize)>,
) -> PyResult<Bound<'py, PyAny>> {
    let target = buffer(arena, "arena", true)?;
    let mut held = Vec::with_capacity(pools.len());
    let mut plan = Vec::with_capacity(pools.len());
    for (src, base, layer_stride, block_stride, piece, layers, blocks) in &pools {
        let buf = buffer(src, "src", false)?;
        plan.push(Pool {
            base: *base,
            layer_stride: *layer_stride,
            block_stride: *block_stride,
            piece: *piece,
            layers: *layers,
            blocks: *blocks,
            src: buf.buf_ptr() as usize,
            src_len: buf.len_bytes(),
        });
        held.push(buf);
    }
    let (addr, len) = (target.buf_ptr() as usize, target.len_bytes());
    // SAFETY: the arena and every source stay exported (alive, not resized) until they drop
    // at the end of this function, and `meta` is an immutable bytes object's; the caller
    // holds the connection's lock.
    let outcome = py.detach(|| unsafe { put(fd, rid, meta, first, &plan, addr, len) });
    drop(held);
    drop(target);
    match outcome {
        Ok(Outcome::Stored { stored, resident }) => ("stored", stored, resident)
            .into_pyobject(py)
            .map(|t| t.into_any()),
        Ok(Outcome::Held { resident }) => {
            ("held", resident).into_pyobject(py).map(|t| t.into_any())
        }
        Ok(Outcome::Refused { meta }) => ("refused", PyBytes::new(py, &meta))
            .into_pyobject(py)
            .map(|t| t.into_any()),
        Ok(Outcome::Mismatch { reason }) => {
            ("mismatch", reason).into_pyobject(py).map(|t| t.into_any())
        }
        Err(PutError::Io(err)) => Err(err.into()),
        Err(PutError::Closed) => Err(PyConnectionError::new_err(
            "the agent closed the connection",
        )),
        Err(PutError::Protocol(why)) => Err(PyValueError::new_err(why)),
    }
}
