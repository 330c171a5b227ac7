//! `kvpool_native.WireEncoder` for `kvpool_agent/server/events.py`, and
//! `Engine.drain_wire`, which turns the engine's buffered events into one published batch
//! without a Python object per event.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::{wire_hash, WireEncoder, REASONS};
use crate::engine::log::{Event, Reason};
use crate::engine::py::unpack_tokens;
use crate::engine::Engine;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyWireEncoder>()?;
    Ok(())
}

#[pyclass(name = "WireEncoder", module = "kvpool_native")]
pub struct PyWireEncoder {
    inner: WireEncoder,
}

fn tier_of(name: &str) -> PyResult<u8> {
    match name {
        "primary" => Ok(0),
        "secondary" => Ok(1),
        other => Err(PyValueError::new_err(format!(
            "tier: 'primary' or 'secondary', got {other:?}"
        ))),
    }
}

fn reason_of(name: &str) -> PyResult<Reason> {
    REASONS
        .iter()
        .copied()
        .find(|r| r.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown removal reason {name:?}")))
}

/// An event as the Python engine's dataclasses give it (`kvpool_agent.cache.events`).
fn event_of(obj: &Bound<'_, PyAny>) -> PyResult<Event> {
    let kind = obj.get_type().name()?.to_string();
    Ok(match kind.as_str() {
        "BlockStored" => {
            let tokens: Vec<u64> = obj.getattr("token_ids")?.extract()?;
            Event::Stored {
                key: obj.getattr("key")?.extract()?,
                parent: obj.getattr("parent_key")?.extract()?,
                tokens: tokens.into_boxed_slice(),
                tier: tier_of(&obj.getattr("tier")?.extract::<String>()?)?,
                priority: obj.getattr("priority")?.extract()?,
            }
        }
        "BlockUpdated" => Event::Updated {
            key: obj.getattr("key")?.extract()?,
            tier: tier_of(&obj.getattr("tier")?.extract::<String>()?)?,
            priority: obj.getattr("priority")?.extract()?,
            tokens: obj
                .getattr("token_ids")?
                .extract::<Option<Vec<u64>>>()?
                .map(Vec::into_boxed_slice),
        },
        "BlockRemoved" => Event::Removed {
            key: obj.getattr("key")?.extract()?,
            tier: tier_of(&obj.getattr("tier")?.extract::<String>()?)?,
            reason: reason_of(&obj.getattr("reason")?.extract::<String>()?)?,
        },
        "AllBlocksCleared" => Event::AllCleared,
        other => {
            return Err(PyValueError::new_err(format!("unknown KV event {other}")));
        }
    })
}

fn batch<'py>(py: Python<'py>, out: Option<(Vec<u8>, usize)>) -> PyResult<Bound<'py, PyAny>> {
    match out {
        None => Ok(py.None().into_bound(py)),
        Some((bytes, count)) => Ok((PyBytes::new(py, &bytes), count)
            .into_pyobject(py)?
            .into_any()),
    }
}

#[pymethods]
impl PyWireEncoder {
    #[new]
    fn new(block_size: u64, primary_medium: &str) -> Self {
        PyWireEncoder {
            inner: WireEncoder::new(block_size, primary_medium),
        }
    }

    /// `WireEncoder.name_chain`: block `i` of the flat `tokens` (`len(keys)` blocks of
    /// `block_size`) goes out under the wire hash of `keys[i]` when stored. `tokens` is a list
    /// of ints, or `bytes` of `uint32` little-endian (`chain_tokens_packed`).
    fn name_chain(
        &mut self,
        tokens: &Bound<'_, PyAny>,
        keys: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<()> {
        let tokens: Vec<u64> = match tokens.cast::<PyBytes>() {
            Ok(packed) => unpack_tokens("name_chain", packed.as_bytes())?,
            Err(_) => tokens.extract()?,
        };
        let bs = self.inner.block_size as usize;
        if tokens.len() != keys.len() * bs {
            return Err(PyValueError::new_err(format!(
                "name_chain: {} tokens for {} keys of {bs} tokens",
                tokens.len(),
                keys.len()
            )));
        }
        for (i, key) in keys.iter().enumerate() {
            self.inner
                .name(&tokens[i * bs..(i + 1) * bs], wire_hash(key.as_bytes()));
        }
        Ok(())
    }

    /// The batch of `events` (the Python engine's event objects) as `encode_batch` writes
    /// it, and how many wire events it holds; None when none.
    fn encode_batch<'py>(
        &mut self,
        py: Python<'py>,
        events: &Bound<'py, PyList>,
        ts: f64,
        rank: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let events: Vec<Event> = events
            .iter()
            .map(|e| event_of(&e))
            .collect::<PyResult<_>>()?;
        batch(py, self.inner.encode_batch(events.iter(), ts, rank))
    }

    /// Blocks whose last copy went, by reason (the reasons seen so far).
    #[getter]
    fn removed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (reason, &n) in REASONS.iter().zip(self.inner.removed.iter()) {
            if n > 0 {
                out.set_item(reason.name(), n)?;
            }
        }
        Ok(out)
    }

    /// `WireEncoder.watch`: report `key`'s block through `take_gone` once it is gone.
    fn watch(&mut self, key: i64) {
        self.inner.watch(key);
    }

    /// `WireEncoder.take_gone`: the watched keys whose blocks went since the last call.
    fn take_gone(&mut self) -> Vec<i64> {
        self.inner.take_gone()
    }

    #[getter]
    fn watched(&self) -> usize {
        self.inner.watched_len()
    }

    #[getter]
    fn pending_names(&self) -> usize {
        self.inner.pending_names()
    }

    #[getter]
    fn live_blocks(&self) -> usize {
        self.inner.live_blocks()
    }

    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }
}

/// `Engine.drain_wire`: the engine's buffered events (up to `limit`, oldest first) drained
/// and encoded by `encoder` into one batch: `(bytes, wire events)`, or None when they make
/// no wire event.
pub fn drain_wire<'py>(
    py: Python<'py>,
    engine: &mut Engine,
    encoder: &Bound<'py, PyWireEncoder>,
    ts: f64,
    rank: i64,
    limit: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let events = engine.events.drain(limit);
    let out = encoder
        .borrow_mut()
        .inner
        .encode_batch(events.iter(), ts, rank);
    batch(py, out)
}
