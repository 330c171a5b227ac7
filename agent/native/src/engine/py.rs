//! `kvpool_native.Engine`: the engine's operations for `kvpool_agent/cache/native.py`.
//!
//! Plain data in and out: token ids as the packed `uint32` bytes the Python façade already
//! builds when it validates a request (or a list of ints when some id needs more than 32
//! bits), results as ints, lists and tuples. Errors are the Python engine's own exception
//! classes (`kvpool_agent.cache.errors`) with the same messages.

use std::sync::Arc;

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::log::Event;
use super::pool::TierLayout;
use super::store::NONE;
use super::{Engine, EngineConfig, EngineError, Retention, Settings};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(pack_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(tokens_valid, m)?)?;
    Ok(())
}

/// The packed `uint32` bytes of a list or tuple of token ids, when every one is an `int`
/// (exactly: no bool, no int subclass) in `[0, 2**32)`; None otherwise, and the caller
/// validates the slow way (`sequences.check_and_pack`, which says what is wrong).
#[pyfunction]
fn pack_tokens<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
    fn pack<'py>(items: impl ExactSizeIterator<Item = Bound<'py, PyAny>>) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(items.len() * 4);
        for item in items {
            if !item.is_exact_instance_of::<pyo3::types::PyInt>() {
                return None;
            }
            let value: u32 = item.extract().ok()?;
            out.extend_from_slice(&value.to_le_bytes());
        }
        Some(out)
    }
    let out = if let Ok(list) = tokens.cast_exact::<PyList>() {
        pack(list.iter())?
    } else if let Ok(tuple) = tokens.cast_exact::<PyTuple>() {
        pack(tuple.iter())?
    } else {
        return None;
    };
    Some(PyBytes::new(py, &out))
}

/// Whether a list or tuple holds only token ids: `int`s (exactly) in `[0, 2**63)`. The check
/// `pack_tokens` leaves to the caller when some id needs more than 32 bits (no tokenizer emits
/// one, but the API takes ids below 2**63); False sends the caller the slow way, which says
/// what is wrong.
#[pyfunction]
fn tokens_valid(tokens: &Bound<'_, PyAny>) -> bool {
    fn valid<'py>(mut items: impl Iterator<Item = Bound<'py, PyAny>>) -> bool {
        items.all(|item| {
            item.is_exact_instance_of::<pyo3::types::PyInt>()
                && item.extract::<u64>().is_ok_and(|v| v < 1 << 63)
        })
    }
    if let Ok(list) = tokens.cast_exact::<PyList>() {
        valid(list.iter())
    } else if let Ok(tuple) = tokens.cast_exact::<PyTuple>() {
        valid(tuple.iter())
    } else {
        false
    }
}

fn raise(py: Python<'_>, err: EngineError) -> PyErr {
    let name = match err {
        EngineError::UnknownSequence(_) => "UnknownSequenceError",
        EngineError::RequestTooLarge(_) => "RequestTooLargeError",
        EngineError::OutOfBlocks(_) => "OutOfBlocksError",
        EngineError::InvalidTokens(_) => "InvalidTokensError",
    };
    let message = err.to_string();
    match py
        .import("kvpool_agent.cache.errors")
        .and_then(|m| m.getattr(name))
    {
        Ok(class) => match class.call1((message,)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(e) => e,
    }
}

/// Token ids from the packed bytes, else from the list.
fn tokens(packed: Option<&Bound<'_, PyBytes>>, list: Option<Vec<u64>>) -> PyResult<Vec<u64>> {
    if let Some(bytes) = packed {
        return unpack_tokens("tokens", bytes.as_bytes());
    }
    list.ok_or_else(|| PyValueError::new_err("tokens: give the packed bytes or a list"))
}

/// Token ids from `uint32` little-endian bytes (`pack_tokens`' and `chain_tokens_packed`'s
/// form); `what` names the argument in the refusal of a length that is no whole number of
/// tokens.
pub(crate) fn unpack_tokens(what: &str, raw: &[u8]) -> PyResult<Vec<u64>> {
    if !raw.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes of packed tokens (4 a token)",
            raw.len()
        )));
    }
    Ok(raw
        .chunks_exact(4)
        .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect())
}

type RangeTuple = (u64, Option<u64>, u8, Option<u64>);
/// (group, src tier, dst tier, src ids, dst ids)
type CopyTuple = (usize, u8, u8, Vec<u32>, Vec<u32>);

fn retention(spec: Option<(Vec<RangeTuple>, u8, Option<u64>)>) -> Arc<Retention> {
    match spec {
        None => Arc::new(Retention::default_policy()),
        Some((ranges, decode_priority, decode_duration_ms)) => Arc::new(Retention {
            ranges,
            decode_priority,
            decode_duration_ms,
            is_default: false,
        }),
    }
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) => v.extract::<T>().map_err(Into::into),
        None => Err(PyKeyError::new_err(format!(
            "engine config: missing {key:?}"
        ))),
    }
}

use pyo3::conversion::FromPyObjectOwned;

fn layout(d: &Bound<'_, PyDict>) -> PyResult<TierLayout> {
    Ok(TierLayout {
        chunk_bytes: get(d, "chunk_bytes")?,
        num_chunks: get(d, "num_chunks")?,
        group_chunks: get(d, "group_chunks")?,
        block_bytes: get(d, "block_bytes")?,
    })
}

#[pyclass(name = "Engine", module = "kvpool_native")]
pub struct PyEngine {
    pub(crate) inner: Engine,
}

#[pymethods]
impl PyEngine {
    /// `config`: tokens_per_block, windows, full (group or None), tiers (two dicts of
    /// chunk_bytes, num_chunks, group_chunks, block_bytes), group_blocks (two lists),
    /// eviction_policy, enable_block_reuse, enable_partial_reuse, copy_on_partial_reuse,
    /// secondary_offload_min_priority, event_buffer_max_size.
    #[new]
    fn new(config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let tiers: Vec<Bound<'_, PyDict>> = get(config, "tiers")?;
        if tiers.len() != 2 {
            return Err(PyValueError::new_err(
                "engine config: tiers needs two entries",
            ));
        }
        let group_blocks: (Vec<usize>, Vec<usize>) = get(config, "group_blocks")?;
        let cfg = EngineConfig {
            tokens_per_block: get(config, "tokens_per_block")?,
            windows: get(config, "windows")?,
            full: get(config, "full")?,
            tiers: [layout(&tiers[0])?, layout(&tiers[1])?],
            group_blocks: [group_blocks.0, group_blocks.1],
            eviction_policy: get(config, "eviction_policy")?,
            enable_block_reuse: get(config, "enable_block_reuse")?,
            enable_partial_reuse: get(config, "enable_partial_reuse")?,
            copy_on_partial_reuse: get(config, "copy_on_partial_reuse")?,
            secondary_offload_min_priority: get(config, "secondary_offload_min_priority")?,
            event_buffer_max_size: get(config, "event_buffer_max_size")?,
        };
        if cfg.tokens_per_block == 0 {
            return Err(PyValueError::new_err(
                "engine config: tokens_per_block must be positive",
            ));
        }
        let inner = Engine::new(cfg).map_err(PyValueError::new_err)?;
        Ok(PyEngine { inner })
    }

    /// Open a sequence; returns its id. `retention`: None for the default policy, else
    /// (ranges, decode_priority, decode_duration_ms) with ranges of (token_start, token_end,
    /// priority, duration_ms).
    #[pyo3(signature = (namespace, packed, tokens_list, recompute_last_token, retention, now))]
    #[allow(clippy::too_many_arguments)] // the Python signature, one argument per field
    fn open(
        &mut self,
        py: Python<'_>,
        namespace: i64,
        packed: Option<Bound<'_, PyBytes>>,
        tokens_list: Option<Vec<u64>>,
        recompute_last_token: bool,
        retention: Option<(Vec<RangeTuple>, u8, Option<u64>)>,
        now: f64,
    ) -> PyResult<u64> {
        let toks = tokens(packed.as_ref(), tokens_list)?;
        let retention = self::retention(retention);
        self.inner
            .open(namespace, toks, recompute_last_token, retention, now)
            .map_err(|e| raise(py, e))
    }

    #[pyo3(signature = (seq_id, packed, tokens_list, now))]
    fn append(
        &mut self,
        py: Python<'_>,
        seq_id: u64,
        packed: Option<Bound<'_, PyBytes>>,
        tokens_list: Option<Vec<u64>>,
        now: f64,
    ) -> PyResult<()> {
        let toks = tokens(packed.as_ref(), tokens_list)?;
        self.inner
            .append(seq_id, toks, now)
            .map_err(|e| raise(py, e))
    }

    fn commit(&mut self, py: Python<'_>, seq_id: u64, now: f64) -> PyResult<()> {
        self.inner.commit(seq_id, now).map_err(|e| raise(py, e))
    }

    fn release(&mut self, py: Python<'_>, seq_id: u64, discard: bool, now: f64) -> PyResult<()> {
        self.inner
            .release(seq_id, discard, now)
            .map_err(|e| raise(py, e))
    }

    fn has_sequence(&self, seq_id: u64) -> bool {
        self.inner.sequences.contains_key(&seq_id)
    }

    /// (num_tokens, num_reused_tokens, block ids per group, first block per group).
    fn handle<'py>(&self, py: Python<'py>, seq_id: u64) -> PyResult<Bound<'py, PyTuple>> {
        let h = self.inner.handle(seq_id).map_err(|e| raise(py, e))?;
        let tables = PyList::empty(py);
        for t in &h.tables {
            tables.append(PyTuple::new(py, t)?)?;
        }
        (h.num_tokens, h.num_reused_tokens, tables, h.first_block).into_pyobject(py)
    }

    /// The storage copies recorded since the last call, in order: (group, src_tier,
    /// dst_tier, src ids, dst ids).
    fn take_copies(&mut self) -> Vec<CopyTuple> {
        self.inner
            .take_copies()
            .into_iter()
            .map(|c| (c.group, c.src_tier, c.dst_tier, c.src, c.dst))
            .collect()
    }

    /// A policy-curve query with every full block of the tokens, opening nothing.
    #[pyo3(signature = (namespace, packed, tokens_list))]
    fn query_curves(
        &mut self,
        namespace: i64,
        packed: Option<Bound<'_, PyBytes>>,
        tokens_list: Option<Vec<u64>>,
    ) -> PyResult<()> {
        let toks = tokens(packed.as_ref(), tokens_list)?;
        self.inner.query_curves(namespace, &toks);
        Ok(())
    }

    /// Whether opens are policy-curve queries (on by default).
    fn set_curve_queries(&mut self, on: bool) {
        self.inner.accesses.muted = !on;
    }

    #[pyo3(signature = (namespace, packed, tokens_list))]
    fn lookup(
        &self,
        namespace: i64,
        packed: Option<Bound<'_, PyBytes>>,
        tokens_list: Option<Vec<u64>>,
    ) -> PyResult<Vec<u8>> {
        let toks = tokens(packed.as_ref(), tokens_list)?;
        Ok(self.inner.lookup(namespace, &toks))
    }

    fn clear(&mut self, now: f64) -> usize {
        self.inner.clear(now)
    }

    fn switch_policy(&mut self, policy: &str, now: f64) -> PyResult<()> {
        self.inner
            .switch_policy(policy, now)
            .map_err(PyValueError::new_err)
    }

    /// New live settings (see `core.CoreSettings`).
    #[pyo3(signature = (
        eviction_policy, enable_block_reuse, enable_partial_reuse, copy_on_partial_reuse,
        secondary_offload_min_priority, event_buffer_max_size, now
    ))]
    #[allow(clippy::too_many_arguments)] // one argument per setting
    fn configure(
        &mut self,
        eviction_policy: String,
        enable_block_reuse: bool,
        enable_partial_reuse: bool,
        copy_on_partial_reuse: bool,
        secondary_offload_min_priority: u8,
        event_buffer_max_size: usize,
        now: f64,
    ) -> PyResult<()> {
        let settings = Settings {
            eviction_policy,
            enable_block_reuse,
            enable_partial_reuse,
            copy_on_partial_reuse,
            secondary_offload_min_priority,
            event_buffer_max_size,
        };
        self.inner
            .configure(settings, now)
            .map_err(PyValueError::new_err)
    }

    /// Counters in `CacheStats` field order (two-tier counters as two entries each):
    /// queries_tokens, queries_blocks, hits_tokens x2, hits_blocks x2, partial_hit_tokens,
    /// capacity_miss_tokens, capacity_miss_blocks, evictions x2, offloads, onboards,
    /// chunk_moves, sequences_opened.
    fn counters(&self) -> [u64; 16] {
        let s = &self.inner.stats;
        [
            s.queries_tokens,
            s.queries_blocks,
            s.hits_tokens[0],
            s.hits_tokens[1],
            s.hits_blocks[0],
            s.hits_blocks[1],
            s.partial_hit_tokens,
            s.capacity_miss_tokens,
            s.capacity_miss_blocks,
            s.evictions[0],
            s.evictions[1],
            s.offloads,
            s.onboards,
            s.chunk_moves,
            s.sequences_opened,
            0,
        ]
    }

    /// Set every counter, in `counters()`' order (the last entry is ignored).
    fn set_counters(&mut self, values: Vec<u64>) -> PyResult<()> {
        if values.len() < 15 {
            return Err(PyValueError::new_err(
                "set_counters: 15 values, in counters() order",
            ));
        }
        let s = &mut self.inner.stats;
        s.queries_tokens = values[0];
        s.queries_blocks = values[1];
        s.hits_tokens = [values[2], values[3]];
        s.hits_blocks = [values[4], values[5]];
        s.partial_hit_tokens = values[6];
        s.capacity_miss_tokens = values[7];
        s.capacity_miss_blocks = values[8];
        s.evictions = [values[9], values[10]];
        s.offloads = values[11];
        s.onboards = values[12];
        s.chunk_moves = values[13];
        s.sequences_opened = values[14];
        Ok(())
    }

    /// Counters, as `CacheStats` names them.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner.stats;
        let d = PyDict::new(py);
        d.set_item("queries_tokens", s.queries_tokens)?;
        d.set_item("queries_blocks", s.queries_blocks)?;
        d.set_item("hits_tokens", s.hits_tokens.to_vec())?;
        d.set_item("hits_blocks", s.hits_blocks.to_vec())?;
        d.set_item("partial_hit_tokens", s.partial_hit_tokens)?;
        d.set_item("capacity_miss_tokens", s.capacity_miss_tokens)?;
        d.set_item("capacity_miss_blocks", s.capacity_miss_blocks)?;
        d.set_item("evictions", s.evictions.to_vec())?;
        d.set_item("offloads", s.offloads)?;
        d.set_item("onboards", s.onboards)?;
        d.set_item("chunk_moves", s.chunk_moves)?;
        d.set_item("sequences_opened", s.sequences_opened)?;
        Ok(d)
    }

    /// The buffered events encoded for the wire in one batch (`kvpool_native.WireEncoder`).
    #[pyo3(signature = (encoder, ts, rank, limit=None))]
    fn drain_wire<'py>(
        &mut self,
        py: Python<'py>,
        encoder: &Bound<'py, crate::wire::py::PyWireEncoder>,
        ts: f64,
        rank: i64,
        limit: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        crate::wire::py::drain_wire(py, &mut self.inner, encoder, ts, rank, limit)
    }

    /// Events, oldest first: ("stored", key, parent_key, tokens, tier, priority),
    /// ("updated", key, tier, priority), ("removed", key, tier, reason), ("cleared",).
    #[pyo3(signature = (limit=None))]
    fn drain_events<'py>(
        &mut self,
        py: Python<'py>,
        limit: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for event in self.inner.events.drain(limit) {
            let item = match event {
                Event::Stored {
                    key,
                    parent,
                    tokens,
                    tier,
                    priority,
                } => (
                    "stored",
                    key,
                    parent,
                    PyTuple::new(py, tokens.iter())?,
                    tier,
                    priority,
                )
                    .into_pyobject(py)?
                    .into_any(),
                Event::Updated {
                    key,
                    tier,
                    priority,
                    tokens,
                } => {
                    let tokens = match tokens {
                        Some(t) => Some(PyTuple::new(py, t.iter())?),
                        None => None,
                    };
                    ("updated", key, tier, priority, tokens)
                        .into_pyobject(py)?
                        .into_any()
                }
                Event::Removed { key, tier, reason } => ("removed", key, tier, reason.name())
                    .into_pyobject(py)?
                    .into_any(),
                Event::AllCleared => ("cleared",).into_pyobject(py)?.into_any(),
            };
            out.append(item)?;
        }
        Ok(out)
    }

    #[getter]
    fn events_len(&self) -> usize {
        self.inner.events.len()
    }

    #[getter]
    fn events_dropped(&self) -> u64 {
        self.inner.events.dropped
    }

    #[getter]
    fn events_enabled(&self) -> bool {
        self.inner.events.enabled()
    }

    fn resize_events(&mut self, max_size: usize) {
        self.inner.resize_events(max_size);
    }

    #[getter]
    fn ghost_len(&self) -> usize {
        self.inner.ghost.len()
    }

    fn ghost_keys(&self) -> Vec<i64> {
        self.inner.ghost.keys()
    }

    fn count_missed(&mut self, blocks: u64) {
        self.inner.count_missed(blocks);
    }

    fn ghost_contains(&self, key: i64) -> bool {
        self.inner.ghost.contains(key)
    }

    #[getter]
    fn num_nodes(&self) -> usize {
        self.inner.num_nodes()
    }

    #[getter]
    fn num_open_sequences(&self) -> usize {
        self.inner.num_open_sequences()
    }

    #[getter]
    fn group_capacity(&self) -> Vec<usize> {
        self.inner.group_capacity().to_vec()
    }

    /// Per group: ((capacity, free, pinned, evictable) of the primary tier, same of the
    /// secondary).
    fn usage(&self) -> Vec<[(usize, usize, usize, usize); 2]> {
        self.inner.usage()
    }

    /// Which accessed keys to keep for a miss-ratio curve and a policy curve fed from Python
    /// (a key is kept when `key & mask == 0`; no mask: none kept for that curve). The
    /// engine's own curves (`kvpool_native.MissRatioCurve.attach`) need none.
    #[pyo3(signature = (mrc_mask=None, mini_mask=None))]
    fn set_sampling(&mut self, mrc_mask: Option<u64>, mini_mask: Option<u64>) {
        self.inner.accesses.mrc_mask = mrc_mask;
        self.inner.accesses.mini_mask = mini_mask;
    }

    /// (accesses since the last call and the miss-ratio curve's sampled keys, the policy
    /// curve's sampled chains, one per query).
    fn take_accesses(&mut self) -> (u64, Vec<i64>, Vec<Vec<i64>>) {
        let acc = &mut self.inner.accesses;
        let count = std::mem::take(&mut acc.count);
        (
            count,
            std::mem::take(&mut acc.mrc_keys),
            std::mem::take(&mut acc.mini_chains),
        )
    }

    /// Every node, parents before children: (node id, key, parent id (a root's id for a
    /// namespace's first blocks, see `roots`), depth, priority, expires_at or None,
    /// stored_at, last_used, hits, tokens, per group (tier, block id, ref_count) or None).
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let st = &self.inner.store;
        for n in self.inner.iter_nodes() {
            let rec = &st.nodes[n as usize];
            let parent = rec.parent;
            let blocks = PyList::empty(py);
            for g in 0..self.inner.num_groups {
                let b = st.block_of(n, g);
                if b == NONE {
                    blocks.append(py.None())?;
                } else {
                    let br = &st.blocks[b as usize];
                    blocks.append((br.tier, br.block_id, br.ref_count))?;
                }
            }
            let expires = st.expires_at(n);
            let toks = PyTuple::new(py, st.node_tokens(n).to_vec())?;
            out.append((
                n,
                rec.key,
                parent,
                rec.depth,
                rec.priority,
                expires,
                rec.stored_at,
                rec.last_used,
                rec.hits,
                toks,
                blocks,
            ))?;
        }
        Ok(out)
    }

    /// The namespaces' roots, in the order they were made: (node id, namespace key).
    fn roots(&self) -> Vec<(u32, i64)> {
        let st = &self.inner.store;
        self.inner
            .root_order
            .iter()
            .map(|&r| (r, st.nodes[r as usize].key))
            .collect()
    }

    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    /// `memory_bytes` by part (for the memory benchmark).
    fn memory_breakdown(&self) -> Vec<(&'static str, usize)> {
        self.inner.memory_breakdown()
    }

    /// For tests: the mixture policy of (tier, group), if it runs one: (leader, scores,
    /// switches).
    fn mixture_state(&self, tier: usize, group: usize) -> Option<(usize, Vec<f64>, u64)> {
        self.inner.queues[tier][group]
            .mixture()
            .map(|m| (m.leader(), m.scores().to_vec(), m.switches()))
    }

    /// For tests: pop every queued block of (tier, group) in eviction order, returning
    /// (block id, node key) each; the queue is left empty (destructive).
    fn drain_queue(&mut self, tier: usize, group: usize, now: f64) -> Vec<(u32, i64)> {
        let eng = &mut self.inner;
        let mut out = Vec::new();
        while let Some(b) = eng.queues[tier][group].pop(now, &mut eng.store) {
            let rec = &eng.store.blocks[b as usize];
            out.push((rec.block_id, eng.store.nodes[rec.node as usize].key));
        }
        out
    }
}
