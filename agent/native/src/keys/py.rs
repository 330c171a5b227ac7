//! `kvpool_native.chain_tokens`: the compiled twin of `dataplane.keys.chain_tokens`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::MAX_PERSON_BYTES;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(chain_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(chain_tokens_packed, m)?)?;
    Ok(())
}

/// The synthetic tokens of a chain of engine keys (a list of `bytes`), as a list of ints:
/// `tokens_per_block` per key, first key first. The caller has checked the keys
/// (`check_keys`); a non-`bytes` item is a TypeError here.
#[pyfunction]
fn chain_tokens<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyList>,
    tokens_per_block: usize,
    person: &[u8],
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, tokens_of(keys, tokens_per_block, person)?)
}

/// `chain_tokens` packed as `uint32` little-endian bytes (`pack_tokens`' form), for a caller
/// that hands them to the engine as they are: no Python int per token.
#[pyfunction]
fn chain_tokens_packed<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyList>,
    tokens_per_block: usize,
    person: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let tokens = tokens_of(keys, tokens_per_block, person)?;
    PyBytes::new_with(py, tokens.len() * 4, |out| {
        for (word, t) in out.chunks_exact_mut(4).zip(&tokens) {
            word.copy_from_slice(&t.to_le_bytes());
        }
        Ok(())
    })
}

fn tokens_of(
    keys: &Bound<'_, PyList>,
    tokens_per_block: usize,
    person: &[u8],
) -> PyResult<Vec<u32>> {
    if tokens_per_block == 0 {
        return Err(PyValueError::new_err("tokens_per_block: at least 1"));
    }
    if person.len() > MAX_PERSON_BYTES {
        return Err(PyValueError::new_err("person: at most 16 bytes"));
    }
    let items: Vec<Bound<'_, PyBytes>> = keys
        .iter()
        .map(|k| k.cast_into::<PyBytes>().map_err(PyErr::from))
        .collect::<PyResult<_>>()?;
    let views: Vec<&[u8]> = items.iter().map(|b| b.as_bytes()).collect();
    Ok(super::chain_tokens(&views, tokens_per_block, person))
}
