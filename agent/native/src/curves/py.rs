//! `kvpool_native.MissRatioCurve` and `kvpool_native.PolicyMiniature`: the compiled curves
//! for `kvpool_agent/cache/native_curves.py`, which gives them the Python classes' interface.
//!
//! Each object either owns its curve (made from Python: fed with `access`, `access_keys`
//! or `access_sampled`, a miniature with `access`, `access_chain` or `queue_chain`) or, once `attach`ed to a `kvpool_native.Engine`, is a
//! view of the curve the engine now holds and feeds on every request: the curve moves into
//! the engine, and reads (`snapshot`, `hits`, `pending`, ...) and `drain` go through the
//! engine. `detach` moves it back, frozen. An engine holds at most one curve of each kind,
//! and only the object that attached it can detach it, so one curve has one view.
//!
//! Results are plain data (tuples, lists, floats); the Python side builds the snapshots.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::miniature::{self, PolicyMiniature};
use super::mrc::{self, MissRatioCurve};
use super::Curves;
use crate::engine::py::PyEngine;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMissRatioCurve>()?;
    m.add_class::<PyPolicyMiniature>()?;
    m.add("MRC_BOUNDS", mrc::BOUNDS.to_vec())?;
    m.add("MINIATURE_RATIOS", miniature::RATIOS.to_vec())?;
    Ok(())
}

fn value_error(message: String) -> PyErr {
    PyValueError::new_err(message)
}

/// Which of an engine's curves a curve type is.
trait Slot: Sized {
    const WHAT: &'static str;
    fn slot(curves: &Curves) -> Option<&Self>;
    fn slot_mut(curves: &mut Curves) -> &mut Option<Self>;
}

impl Slot for MissRatioCurve {
    const WHAT: &'static str = "miss-ratio curve";
    fn slot(curves: &Curves) -> Option<&Self> {
        curves.mrc.as_ref()
    }
    fn slot_mut(curves: &mut Curves) -> &mut Option<Self> {
        &mut curves.mrc
    }
}

impl Slot for PolicyMiniature {
    const WHAT: &'static str = "policy miniature";
    fn slot(curves: &Curves) -> Option<&Self> {
        curves.miniature.as_ref()
    }
    fn slot_mut(curves: &mut Curves) -> &mut Option<Self> {
        &mut curves.miniature
    }
}

/// Where a curve lives: in its Python object, or in the engine that feeds it.
enum Home<T> {
    Own(Box<T>),
    Engine(Py<PyEngine>),
}

fn busy(err: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(format!("the engine is in use: {err}"))
}

impl<T: Slot> Home<T> {
    fn gone() -> PyErr {
        PyRuntimeError::new_err(format!(
            "the engine no longer holds this {} (detached elsewhere)",
            T::WHAT
        ))
    }

    fn read<R>(&self, py: Python<'_>, f: impl FnOnce(&T) -> R) -> PyResult<R> {
        match self {
            Home::Own(curve) => Ok(f(curve)),
            Home::Engine(engine) => {
                let engine = engine.bind(py).try_borrow().map_err(busy)?;
                T::slot(&engine.inner.curves).map(f).ok_or_else(Self::gone)
            }
        }
    }

    fn write<R>(&mut self, py: Python<'_>, f: impl FnOnce(&mut T) -> R) -> PyResult<R> {
        match self {
            Home::Own(curve) => Ok(f(curve)),
            Home::Engine(engine) => {
                let mut engine = engine.bind(py).try_borrow_mut().map_err(busy)?;
                T::slot_mut(&mut engine.inner.curves)
                    .as_mut()
                    .map(f)
                    .ok_or_else(Self::gone)
            }
        }
    }

    fn attach(&mut self, engine: &Bound<'_, PyEngine>) -> PyResult<()> {
        if let Home::Engine(_) = self {
            return Err(PyRuntimeError::new_err(format!(
                "this {} is attached to an engine already",
                T::WHAT
            )));
        }
        let mut eng = engine.try_borrow_mut().map_err(busy)?;
        let slot = T::slot_mut(&mut eng.inner.curves);
        if slot.is_some() {
            return Err(PyRuntimeError::new_err(format!(
                "the engine feeds a {} already: detach that one first",
                T::WHAT
            )));
        }
        let Home::Own(curve) = std::mem::replace(self, Home::Engine(engine.clone().unbind()))
        else {
            unreachable!("checked above");
        };
        *slot = Some(*curve);
        Ok(())
    }

    fn detach(&mut self, py: Python<'_>) -> PyResult<()> {
        let Home::Engine(engine) = self else {
            return Ok(());
        };
        let curve = {
            let mut engine = engine.bind(py).try_borrow_mut().map_err(busy)?;
            T::slot_mut(&mut engine.inner.curves).take()
        };
        let curve = curve.ok_or_else(Self::gone)?;
        *self = Home::Own(Box::new(curve));
        Ok(())
    }

    fn attached(&self) -> bool {
        matches!(self, Home::Engine(_))
    }
}

/// `mrc.MissRatioCurve`, compiled; `native_curves.NativeMissRatioCurve` wraps it.
#[pyclass(name = "MissRatioCurve", module = "kvpool_native")]
pub struct PyMissRatioCurve {
    home: Home<MissRatioCurve>,
}

#[pymethods]
impl PyMissRatioCurve {
    /// `MissRatioCurve(capacity, *, max_samples, min_shift, max_ratio)` (`max_samples` as a
    /// float: the comparison is the same for every integer a float holds exactly).
    #[new]
    #[pyo3(signature = (
        capacity, *, max_samples=mrc::MAX_SAMPLES, min_shift=mrc::MIN_SHIFT, max_ratio=mrc::MAX_RATIO
    ))]
    fn new(capacity: u64, max_samples: f64, min_shift: u32, max_ratio: f64) -> PyResult<Self> {
        let curve = MissRatioCurve::new(capacity, max_samples, min_shift, max_ratio)
            .map_err(value_error)?;
        Ok(PyMissRatioCurve {
            home: Home::Own(Box::new(curve)),
        })
    }

    /// A fresh curve of the shape a Python curve has (`capacity`, `shift`, `_limit`).
    #[staticmethod]
    fn shaped(capacity: u64, shift: u32, limit: usize) -> PyResult<Self> {
        let curve = MissRatioCurve::with_shape(capacity, shift, limit).map_err(value_error)?;
        Ok(PyMissRatioCurve {
            home: Home::Own(Box::new(curve)),
        })
    }

    #[getter]
    fn capacity(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, MissRatioCurve::capacity)
    }

    #[getter]
    fn shift(&self, py: Python<'_>) -> PyResult<u32> {
        self.home.read(py, MissRatioCurve::shift)
    }

    #[getter]
    fn mask(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, MissRatioCurve::mask)
    }

    #[getter]
    fn rate(&self, py: Python<'_>) -> PyResult<f64> {
        self.home.read(py, MissRatioCurve::rate)
    }

    /// Most keys tracked (the Python curve's `_limit`).
    #[getter]
    fn limit(&self, py: Python<'_>) -> PyResult<usize> {
        self.home.read(py, MissRatioCurve::limit)
    }

    /// Accesses counted, sampled or not (the Python curve's `_seen`).
    #[getter]
    fn seen(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, MissRatioCurve::seen)
    }

    /// Whether an engine holds (and feeds) this curve.
    #[getter]
    fn attached(&self) -> bool {
        self.home.attached()
    }

    fn access(&mut self, py: Python<'_>, key: i64) -> PyResult<()> {
        self.home.write(py, |c| c.access(key))
    }

    /// `access_nodes` with the nodes' keys.
    fn access_keys(&mut self, py: Python<'_>, keys: Vec<i64>) -> PyResult<()> {
        self.home.write(py, |c| c.access_keys(keys.into_iter()))
    }

    fn access_sampled(&mut self, py: Python<'_>, count: u64, keys: Vec<i64>) -> PyResult<()> {
        self.home.write(py, |c| c.access_sampled(count, &keys))
    }

    /// (capacity, rate, cumulative, distance_sum): `CurveSnapshot`'s fields.
    #[pyo3(signature = (adjusted=true))]
    fn snapshot(&self, py: Python<'_>, adjusted: bool) -> PyResult<(u64, f64, Vec<f64>, f64)> {
        self.home.read(py, |c| {
            let s = c.snapshot(adjusted);
            (s.capacity, s.rate, s.cumulative, s.distance_sum)
        })
    }

    /// Keys tracked now.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.home.read(py, MissRatioCurve::len)
    }

    /// Move this curve into `engine`, which feeds it from then on; this object becomes its
    /// view. The engine must hold no miss-ratio curve.
    fn attach(&mut self, engine: &Bound<'_, PyEngine>) -> PyResult<()> {
        self.home.attach(engine)
    }

    /// Take the curve back from the engine (which then feeds none); a no-op when not
    /// attached.
    fn detach(&mut self, py: Python<'_>) -> PyResult<()> {
        self.home.detach(py)
    }

    fn memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.home.read(py, MissRatioCurve::memory_bytes)
    }
}

/// (policy, capacity, rate, ratios, hits, accesses, dropped)
type MiniSnapshot = (String, u64, f64, Vec<f64>, Vec<u64>, u64, u64);

/// `miniature.PolicyMiniature`, compiled; `native_curves.NativePolicyMiniature` wraps it.
#[pyclass(name = "PolicyMiniature", module = "kvpool_native")]
pub struct PyPolicyMiniature {
    home: Home<PolicyMiniature>,
}

#[pymethods]
impl PyPolicyMiniature {
    /// `PolicyMiniature(policy, capacity, *, ratios, min_blocks, max_pending, shift)`
    /// (`min_blocks` as a float: the comparison is the same for every integer a float holds
    /// exactly).
    #[new]
    #[pyo3(signature = (
        policy, capacity, *, ratios=miniature::RATIOS.to_vec(), min_blocks=miniature::MIN_BLOCKS,
        max_pending=miniature::MAX_PENDING, shift=None
    ))]
    fn new(
        policy: &str,
        capacity: u64,
        ratios: Vec<f64>,
        min_blocks: f64,
        max_pending: i64,
        shift: Option<i64>,
    ) -> PyResult<Self> {
        let mini = PolicyMiniature::new(policy, capacity, &ratios, min_blocks, max_pending, shift)
            .map_err(value_error)?;
        Ok(PyPolicyMiniature {
            home: Home::Own(Box::new(mini)),
        })
    }

    #[getter]
    fn policy(&self, py: Python<'_>) -> PyResult<String> {
        self.home.read(py, |m| m.policy().to_string())
    }

    #[getter]
    fn capacity(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, PolicyMiniature::capacity)
    }

    #[getter]
    fn ratios(&self, py: Python<'_>) -> PyResult<Vec<f64>> {
        self.home.read(py, |m| m.ratios().to_vec())
    }

    #[getter]
    fn min_blocks(&self, py: Python<'_>) -> PyResult<f64> {
        self.home.read(py, PolicyMiniature::min_blocks)
    }

    #[getter]
    fn max_pending(&self, py: Python<'_>) -> PyResult<i64> {
        self.home.read(py, |m| m.max_pending)
    }

    #[setter]
    fn set_max_pending(&mut self, py: Python<'_>, value: i64) -> PyResult<()> {
        self.home.write(py, |m| m.max_pending = value)
    }

    #[getter]
    fn shift(&self, py: Python<'_>) -> PyResult<u32> {
        self.home.read(py, PolicyMiniature::shift)
    }

    #[getter]
    fn mask(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, PolicyMiniature::mask)
    }

    #[getter]
    fn rate(&self, py: Python<'_>) -> PyResult<f64> {
        self.home.read(py, PolicyMiniature::rate)
    }

    #[getter]
    fn hits(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.home.read(py, |m| m.hits().to_vec())
    }

    #[getter]
    fn accesses(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, PolicyMiniature::accesses)
    }

    #[getter]
    fn dropped(&self, py: Python<'_>) -> PyResult<u64> {
        self.home.read(py, PolicyMiniature::dropped)
    }

    /// Keys waiting for `drain`.
    #[getter]
    fn num_pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.home.read(py, |m| m.pending().len())
    }

    /// The keys waiting for `drain`, oldest first.
    fn pending(&self, py: Python<'_>) -> PyResult<Vec<i64>> {
        self.home
            .read(py, |m| m.pending().iter().copied().collect())
    }

    /// Whether an engine holds (and feeds) this miniature.
    #[getter]
    fn attached(&self) -> bool {
        self.home.attached()
    }

    fn sizes(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.home.read(py, PolicyMiniature::sizes)
    }

    fn access(&mut self, py: Python<'_>, key: i64) -> PyResult<()> {
        self.home.write(py, |m| m.access(key))
    }

    /// One query's block keys, root first.
    fn access_chain(&mut self, py: Python<'_>, keys: Vec<i64>) -> PyResult<()> {
        self.home.write(py, |m| m.access_chain(keys.into_iter()))
    }

    /// One query's sampled keys, root first.
    fn queue_chain(&mut self, py: Python<'_>, sampled: Vec<i64>) -> PyResult<()> {
        self.home.write(py, |m| m.queue_chain(&sampled))
    }

    /// Replay pending chains until `limit` keys were (all when None); returns how many.
    #[pyo3(signature = (limit=None))]
    fn drain(&mut self, py: Python<'_>, limit: Option<i64>) -> PyResult<u64> {
        self.home.write(py, |m| m.drain(limit))
    }

    /// (policy, capacity, rate, ratios, hits, accesses, dropped): `PolicyCurveSnapshot`'s
    /// fields.
    fn snapshot(&self, py: Python<'_>) -> PyResult<MiniSnapshot> {
        self.home.read(py, |m| {
            (
                m.policy().to_string(),
                m.capacity(),
                m.rate(),
                m.ratios().to_vec(),
                m.hits().to_vec(),
                m.accesses(),
                m.dropped(),
            )
        })
    }

    /// Move this miniature into `engine`, which feeds it from then on; this object becomes
    /// its view. The engine must hold no miniature.
    fn attach(&mut self, engine: &Bound<'_, PyEngine>) -> PyResult<()> {
        self.home.attach(engine)
    }

    /// Take the miniature back from the engine (which then feeds none); a no-op when not
    /// attached.
    fn detach(&mut self, py: Python<'_>) -> PyResult<()> {
        self.home.detach(py)
    }

    fn memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.home.read(py, PolicyMiniature::memory_bytes)
    }
}
