//! Python classes over the compiled orders, so that `tests/native` can run them beside the
//! Python originals on the same operations and compare every answer:
//!
//! - `ShadowTwin(policy, capacity)`: a shadow cache of one expert (`shadow.py` with `lru`,
//!   `reuse-gap`, `lrfu` or `arc`); `step(keys)` and the keys that changed in that step.
//! - `MixtureTwin(capacity, variant)`: a mixture's shared state (`observe`, the leader, the
//!   scores, the shadows' keys).
//! - `MiniTwin(policy, capacity)`: a whole `EvictionQueue` run in a shadow cache, as the
//!   miniature's `_Mini` runs a registry policy.
//! - `EvictionQueueTwin(policy, capacity)`: an `EvictionQueue` over a record store driven
//!   from Python (nodes and blocks created, changed and dropped by hand).
//! - `py_pow`, `py_log2`: the building blocks that must match CPython bit for bit;
//!   `bench_*`: timings of the compiled code alone on a stream.

use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::expert::{Expert, ExpertKind, Tuning};
use super::float;
use super::guarded::{guarded_with, GUARDED_EXPERTS};
use super::mixture::{self, MixturePolicy};
use super::queue::{EvictionQueue, MiniCache};
use super::shadow::{ShadowCache, ShadowNodes};
use super::toy::ToyStore;
use super::vote::vote_with;
use super::{Item, Node, Records, DEFAULT_PRIORITY, MAX_PRIORITY};

fn value_error(message: String) -> PyErr {
    PyValueError::new_err(message)
}

fn tuning(history_floor: Option<usize>) -> Tuning {
    Tuning {
        history_floor,
        ..Tuning::default()
    }
}

/// A mixture by variant name ("mixture": the vote, "guarded", "mixture-v1": the original), with the
/// variant's experts unless `experts` names others.
fn new_mixture(
    capacity: usize,
    variant: &str,
    experts: Option<Vec<String>>,
    history_floor: Option<usize>,
) -> PyResult<MixturePolicy> {
    let kinds = match experts {
        Some(names) => Some(
            names
                .iter()
                .map(|n| ExpertKind::parse(n))
                .collect::<Result<Vec<_>, _>>()
                .map_err(value_error)?,
        ),
        None => None,
    };
    let tuning = tuning(history_floor);
    match variant {
        "mixture" => vote_with(
            capacity,
            kinds.as_deref().unwrap_or(&GUARDED_EXPERTS),
            tuning,
        ),
        "guarded" => guarded_with(
            capacity,
            kinds.as_deref().unwrap_or(&GUARDED_EXPERTS),
            tuning,
        ),
        "mixture-v1" => MixturePolicy::with_experts(
            capacity,
            kinds.as_deref().unwrap_or(&mixture::DEFAULT_EXPERTS),
            mixture::HORIZON,
            None,
            tuning,
        ),
        _ => Err(format!(
            "unknown mixture variant {variant:?}; one of guarded, mixture, mixture-v1"
        )),
    }
    .map_err(value_error)
}

fn sorted_keys(keys: impl Iterator<Item = i64>) -> Vec<i64> {
    let mut keys: Vec<i64> = keys.collect();
    keys.sort_unstable();
    keys
}

/// A shadow cache of one expert.
#[pyclass(module = "kvpool_native")]
pub struct ShadowTwin {
    cache: ShadowCache<Expert>,
    changed: Vec<i64>,
}

#[pymethods]
impl ShadowTwin {
    /// `tick_span`: LRFU's history keeps its ticks as offsets below it (lowered, the
    /// history's tick base moves often and long-kept ticks are kept whole).
    #[new]
    #[pyo3(signature = (policy, capacity, history_floor=None, tick_span=None))]
    fn new(
        policy: &str,
        capacity: usize,
        history_floor: Option<usize>,
        tick_span: Option<u64>,
    ) -> PyResult<Self> {
        let kind = ExpertKind::parse(policy).map_err(value_error)?;
        if tick_span.is_some_and(|s| !(2..=u32::MAX as u64).contains(&s)) {
            return Err(value_error("tick_span: 2 to 2**32 - 1".into()));
        }
        let tuning = Tuning {
            history_floor,
            tick_span,
        };
        let expert = Expert::new(kind, capacity, tuning);
        let cache = ShadowCache::new(capacity, expert).map_err(value_error)?;
        Ok(ShadowTwin {
            cache,
            changed: Vec::new(),
        })
    }

    /// Serve one request; returns its hits. `changed` then holds the keys that left and
    /// entered the cache, in order.
    fn step(&mut self, keys: Vec<i64>) -> usize {
        self.changed.clear();
        let changed = &mut self.changed;
        self.cache.step_with(&keys, |k| changed.push(k))
    }

    #[getter]
    fn changed(&self) -> Vec<i64> {
        self.changed.clone()
    }

    fn keys(&self) -> Vec<i64> {
        sorted_keys(self.cache.keys())
    }

    fn __len__(&self) -> usize {
        self.cache.len()
    }

    fn __contains__(&self, key: i64) -> bool {
        self.cache.contains(key)
    }

    fn memory_bytes(&self) -> usize {
        self.cache.memory_bytes()
    }

    /// `memory_bytes` by part (nodes, index, path, then the order's parts).
    fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        self.cache.memory_parts()
    }

    /// Slots of evicted nodes still held by the order.
    fn held_dead(&self) -> usize {
        self.cache.nodes().held_dead()
    }

    /// The order's internal figures (floats as they are, to compare bit for bit).
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self.cache.queue() {
            Expert::Lru(q) => d.set_item("live", q.len())?,
            Expert::ReuseGap(q) => {
                let (fresh, new_heads, reused, chains, estimates, heads, now) = q.state();
                d.set_item("fresh_gap", fresh)?;
                d.set_item("new_heads", new_heads)?;
                d.set_item("reused_heads", reused)?;
                d.set_item("chains", chains)?;
                d.set_item("estimates", estimates)?;
                d.set_item("head_of", heads)?;
                d.set_item("now", now)?;
                d.set_item("live", q.len())?;
            }
            Expert::Lrfu(q) => {
                d.set_item("history", q.history_len())?;
                d.set_item("live", q.len())?;
            }
            Expert::Arc(q) => {
                let (p, t1, t2, b1, b2) = q.state();
                d.set_item("p", p)?;
                d.set_item("sizes", (t1, t2))?;
                d.set_item("ghosts", (b1, b2))?;
                d.set_item("live", q.len())?;
            }
        }
        Ok(d)
    }

    /// LRFU's `(tick, C)` for `key`, None when not remembered (or not LRFU).
    fn lrfu_history(&self, key: i64) -> Option<(u64, f64)> {
        match self.cache.queue() {
            Expert::Lrfu(q) => q.history_of(key),
            _ => None,
        }
    }

    /// Keys of LRFU's history whose tick is kept whole, not as an offset (0 for another
    /// expert).
    fn lrfu_far(&self) -> usize {
        match self.cache.queue() {
            Expert::Lrfu(q) => q.history_far(),
            _ => 0,
        }
    }

    /// LRFU's remembered keys, oldest first (empty for another expert).
    fn lrfu_order(&self) -> Vec<i64> {
        match self.cache.queue() {
            Expert::Lrfu(q) => q.history_keys(),
            _ => Vec::new(),
        }
    }
}

/// A mixture's shared state, observed without level queues.
#[pyclass(module = "kvpool_native")]
pub struct MixtureTwin {
    policy: MixturePolicy,
    nodes: ShadowNodes,
}

#[pymethods]
impl MixtureTwin {
    #[new]
    #[pyo3(signature = (capacity, variant="mixture", experts=None, history_floor=None))]
    fn new(
        capacity: usize,
        variant: &str,
        experts: Option<Vec<String>>,
        history_floor: Option<usize>,
    ) -> PyResult<Self> {
        Ok(MixtureTwin {
            policy: new_mixture(capacity, variant, experts, history_floor)?,
            nodes: ShadowNodes::default(),
        })
    }

    #[pyo3(signature = (keys, scored=true))]
    fn observe(&mut self, keys: Vec<i64>, scored: bool) {
        self.policy.observe(&keys, scored, &mut self.nodes);
    }

    #[getter]
    fn leader(&self) -> usize {
        self.policy.leader()
    }

    #[getter]
    fn switches(&self) -> u64 {
        self.policy.switches()
    }

    #[getter]
    fn scores(&self) -> Vec<f64> {
        self.policy.scores().to_vec()
    }

    #[getter]
    fn names(&self) -> Vec<&'static str> {
        self.policy.names()
    }

    fn leader_holds(&self, key: i64) -> bool {
        self.policy.leader_holds(key)
    }

    fn shadow_keys(&self, index: usize) -> PyResult<Vec<i64>> {
        let shadow = self
            .policy
            .shadows()
            .get(index)
            .ok_or_else(|| value_error(format!("no shadow {index}")))?;
        Ok(sorted_keys(shadow.keys()))
    }

    fn memory_bytes(&self) -> usize {
        self.policy.memory_bytes()
    }

    /// `memory_bytes` by part (`"<expert>.<part>"`, then the mixture's own).
    fn memory_parts(&self) -> Vec<(String, usize)> {
        self.policy.memory_parts()
    }
}

/// A registry policy's whole queue in a shadow cache (the miniature's `_Mini`).
#[pyclass(module = "kvpool_native")]
pub struct MiniTwin {
    cache: ShadowCache<EvictionQueue>,
    changed: Vec<i64>,
}

#[pymethods]
impl MiniTwin {
    #[new]
    #[pyo3(signature = (policy, capacity, history_floor=None))]
    fn new(policy: &str, capacity: usize, history_floor: Option<usize>) -> PyResult<Self> {
        let queue = EvictionQueue::with_tuning(policy, capacity, tuning(history_floor))
            .map_err(value_error)?;
        Ok(MiniTwin {
            cache: ShadowCache::new(capacity, queue).map_err(value_error)?,
            changed: Vec::new(),
        })
    }

    /// The policy observes the request, then the cache serves it; returns its hits.
    fn step(&mut self, keys: Vec<i64>) -> usize {
        self.changed.clear();
        let changed = &mut self.changed;
        self.cache.observe_and_step(&keys, |k| changed.push(k))
    }

    #[getter]
    fn changed(&self) -> Vec<i64> {
        self.changed.clone()
    }

    fn keys(&self) -> Vec<i64> {
        sorted_keys(self.cache.keys())
    }

    fn __len__(&self) -> usize {
        self.cache.len()
    }

    #[getter]
    fn leader(&self) -> Option<usize> {
        self.cache.queue().mixture().map(MixturePolicy::leader)
    }

    #[getter]
    fn scores(&self) -> Option<Vec<f64>> {
        self.cache.queue().mixture().map(|m| m.scores().to_vec())
    }

    fn memory_bytes(&self) -> usize {
        self.cache.memory_bytes()
    }

    /// Heap bytes of the queue alone (the policy's state, without the shadow's nodes that
    /// stand for the engine's tree).
    fn queue_memory_bytes(&self) -> usize {
        self.cache.queue().memory_bytes()
    }
}

/// An `EvictionQueue` over a record store driven from Python.
#[pyclass(module = "kvpool_native")]
pub struct EvictionQueueTwin {
    queue: EvictionQueue,
    store: ToyStore,
}

impl EvictionQueueTwin {
    fn check_item(&self, item: Item) -> PyResult<()> {
        if self.store.item_alive(item) {
            Ok(())
        } else {
            Err(value_error(format!("no block {item}")))
        }
    }

    fn check_node(&self, node: Node) -> PyResult<()> {
        if self.store.node_alive(node) {
            Ok(())
        } else {
            Err(value_error(format!("no node {node} in the tree")))
        }
    }
}

#[pymethods]
impl EvictionQueueTwin {
    #[new]
    #[pyo3(signature = (policy, capacity, experts=None, history_floor=None))]
    fn new(
        policy: &str,
        capacity: usize,
        experts: Option<Vec<String>>,
        history_floor: Option<usize>,
    ) -> PyResult<Self> {
        let queue = if experts.is_some() {
            EvictionQueue::with_mixture(new_mixture(capacity, policy, experts, history_floor)?)
        } else {
            EvictionQueue::with_tuning(policy, capacity, tuning(history_floor))
                .map_err(value_error)?
        };
        Ok(EvictionQueueTwin {
            queue,
            store: ToyStore::default(),
        })
    }

    #[pyo3(signature = (key, parent=None, last_used=0, priority=DEFAULT_PRIORITY, expires_at=None))]
    fn add_node(
        &mut self,
        key: i64,
        parent: Option<Node>,
        last_used: u64,
        priority: u8,
        expires_at: Option<f64>,
    ) -> PyResult<Node> {
        if let Some(p) = parent {
            self.check_node(p)?;
        }
        if priority > MAX_PRIORITY {
            return Err(value_error(format!(
                "priority {priority} above {MAX_PRIORITY}"
            )));
        }
        Ok(self
            .store
            .add_node(key, parent, last_used, priority, expires_at))
    }

    fn drop_node(&mut self, node: Node) -> PyResult<()> {
        self.check_node(node)?;
        if self.store.num_children(node) != 0 {
            return Err(value_error(format!("node {node} has children")));
        }
        self.store.drop_node(node);
        Ok(())
    }

    fn set_last_used(&mut self, node: Node, last_used: u64) -> PyResult<()> {
        self.check_node(node)?;
        self.store.set_last_used(node, last_used);
        Ok(())
    }

    #[pyo3(signature = (node, priority, expires_at=None))]
    fn set_priority(&mut self, node: Node, priority: u8, expires_at: Option<f64>) -> PyResult<()> {
        self.check_node(node)?;
        if priority > MAX_PRIORITY {
            return Err(value_error(format!(
                "priority {priority} above {MAX_PRIORITY}"
            )));
        }
        self.store.set_priority(node, priority, expires_at);
        Ok(())
    }

    fn add_item(&mut self, node: Node) -> PyResult<Item> {
        self.check_node(node)?;
        Ok(self.store.add_item(node))
    }

    fn free_item(&mut self, item: Item) -> PyResult<()> {
        self.check_item(item)?;
        if self.store.queue_level(item) >= 0 {
            return Err(PyRuntimeError::new_err(format!("block {item} is queued")));
        }
        self.store.free_item(item);
        Ok(())
    }

    fn push(&mut self, item: Item, now: f64) -> PyResult<()> {
        self.check_item(item)?;
        if self.store.queue_level(item) >= 0 {
            return Err(PyRuntimeError::new_err(format!(
                "block {item} is already evictable"
            )));
        }
        self.queue.push(item, now, &mut self.store);
        Ok(())
    }

    fn discard(&mut self, item: Item) -> PyResult<()> {
        self.check_item(item)?;
        self.queue.discard(item, &mut self.store);
        Ok(())
    }

    fn pop(&mut self, now: f64) -> Option<Item> {
        self.queue.pop(now, &mut self.store)
    }

    fn requeue(&mut self, item: Item, now: f64) -> PyResult<()> {
        self.check_item(item)?;
        self.queue.requeue(item, now, &mut self.store);
        Ok(())
    }

    #[pyo3(signature = (keys, scored=true))]
    fn observe(&mut self, keys: Vec<i64>, scored: bool) {
        self.queue.observe(&keys, scored, &mut self.store);
    }

    fn __len__(&self) -> usize {
        self.queue.len()
    }

    fn contains(&self, item: Item) -> PyResult<bool> {
        self.check_item(item)?;
        Ok(self.store.queue_level(item) >= 0)
    }

    fn queue_level(&self, item: Item) -> PyResult<i16> {
        self.check_item(item)?;
        Ok(self.store.queue_level(item))
    }

    fn watches_requests(&self) -> bool {
        self.queue.watches_requests()
    }

    #[getter]
    fn leader(&self) -> Option<usize> {
        self.queue.mixture().map(MixturePolicy::leader)
    }

    #[getter]
    fn switches(&self) -> Option<u64> {
        self.queue.mixture().map(MixturePolicy::switches)
    }

    #[getter]
    fn scores(&self) -> Option<Vec<f64>> {
        self.queue.mixture().map(|m| m.scores().to_vec())
    }

    /// Nodes out of the tree that a policy still holds, and all holds.
    fn holds(&self) -> (usize, u64) {
        (self.store.held_dead(), self.store.total_holds())
    }

    fn memory_bytes(&self) -> usize {
        self.queue.memory_bytes()
    }

    /// `memory_bytes` by part (a mixture's by shadow and part).
    fn memory_parts(&self) -> Vec<(String, usize)> {
        self.queue.memory_parts()
    }
}

/// `base ** exp` as the policies compute it.
#[pyfunction]
fn py_pow(base: f64, exp: f64) -> f64 {
    float::pow(base, exp)
}

/// `math.log2(x)` as the policies compute it.
#[pyfunction]
fn py_log2(x: f64) -> f64 {
    float::log2(x)
}

/// One expert's shadow cache on `requests`, compiled code only: (hits, nanoseconds).
#[pyfunction]
fn bench_shadow(
    py: Python<'_>,
    policy: &str,
    capacity: usize,
    requests: Vec<Vec<i64>>,
) -> PyResult<(u64, u64)> {
    let kind = ExpertKind::parse(policy).map_err(value_error)?;
    let mut cache = ShadowCache::new(capacity, Expert::new(kind, capacity, Tuning::default()))
        .map_err(value_error)?;
    Ok(py.detach(|| {
        let start = Instant::now();
        let hits: u64 = requests.iter().map(|r| cache.step(r) as u64).sum();
        (hits, start.elapsed().as_nanos() as u64)
    }))
}

/// A registry policy run as the miniature runs it (observe, then a shadow over the whole
/// queue), compiled code only: (hits, nanoseconds, memory_bytes at the end).
#[pyfunction]
fn bench_mini(
    py: Python<'_>,
    policy: &str,
    capacity: usize,
    requests: Vec<Vec<i64>>,
) -> PyResult<(u64, u64, usize)> {
    let mut cache = MiniCache::mini(policy, capacity).map_err(value_error)?;
    Ok(py.detach(|| {
        let start = Instant::now();
        let mut hits = 0u64;
        for keys in &requests {
            hits += cache.observe_and_step(keys, |_| {}) as u64;
        }
        let ns = start.elapsed().as_nanos() as u64;
        (hits, ns, cache.memory_bytes())
    }))
}

/// Raw queue operations over `blocks` flat blocks, compiled code only: `rounds` times, every
/// block is used (a new tick) and pushed, then every block popped. Returns (operations,
/// nanoseconds).
#[pyfunction]
fn bench_queue(py: Python<'_>, policy: &str, blocks: u32, rounds: u32) -> PyResult<(u64, u64)> {
    let mut queue = EvictionQueue::new(policy, blocks as usize).map_err(value_error)?;
    let mut store = ToyStore::default();
    let root = store.add_node(0, None, 0, DEFAULT_PRIORITY, None);
    let items: Vec<Item> = (0..blocks)
        .map(|b| {
            let node = store.add_node(b as i64 + 1, Some(root), 0, DEFAULT_PRIORITY, None);
            store.add_item(node)
        })
        .collect();
    Ok(py.detach(|| {
        let start = Instant::now();
        let mut tick = 0u64;
        let mut ops = 0u64;
        for _ in 0..rounds {
            for &item in &items {
                tick += 1;
                store.set_last_used(store.node(item), tick);
                queue.push(item, 0.0, &mut store);
            }
            while queue.pop(0.0, &mut store).is_some() {
                ops += 2;
            }
        }
        (ops, start.elapsed().as_nanos() as u64)
    }))
}

/// A mixture observing `requests`, compiled code only: (leader at the end, nanoseconds).
#[pyfunction]
fn bench_mixture(
    py: Python<'_>,
    variant: &str,
    capacity: usize,
    requests: Vec<Vec<i64>>,
) -> PyResult<(usize, u64)> {
    let mut policy = new_mixture(capacity, variant, None, None)?;
    let mut nodes = ShadowNodes::default();
    Ok(py.detach(|| {
        let start = Instant::now();
        for keys in &requests {
            policy.observe(keys, true, &mut nodes);
        }
        (policy.leader(), start.elapsed().as_nanos() as u64)
    }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ShadowTwin>()?;
    m.add_class::<MixtureTwin>()?;
    m.add_class::<MiniTwin>()?;
    m.add_class::<EvictionQueueTwin>()?;
    m.add_function(wrap_pyfunction!(py_pow, m)?)?;
    m.add_function(wrap_pyfunction!(py_log2, m)?)?;
    m.add_function(wrap_pyfunction!(bench_shadow, m)?)?;
    m.add_function(wrap_pyfunction!(bench_mini, m)?)?;
    m.add_function(wrap_pyfunction!(bench_queue, m)?)?;
    m.add_function(wrap_pyfunction!(bench_mixture, m)?)?;
    Ok(())
}
