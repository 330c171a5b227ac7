//! `kvpool_native.copy_spans`, `kvpool_native.Receiver` and `kvpool_native.Sender`: the data
//! plane's byte movers for `kvpool_agent/dataplane` (`shm.py`'s copies into and out of a
//! mapped arena, `server.py`'s PUT receives and GET sends).
//!
//! Buffers are any object with the buffer protocol, C-contiguous (an `mmap`, a `memoryview`,
//! a numpy array, a `bytearray`); a destination must be writable. Offsets are packed arrays of
//! int64 (numpy). The bytes move without the GIL, and the buffers stay exported meanwhile
//! (an `mmap` cannot be closed, a `bytearray` not resized, under a copy or a receiver).

use std::time::Duration;

use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::{PyBufferError, PyConnectionError, PyValueError};
use pyo3::prelude::*;

use super::{copy_spans as copy, Receiver, Sender, Side, StreamError};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(copy_spans, m)?)?;
    m.add_class::<PyReceiver>()?;
    m.add_class::<PySender>()?;
    Ok(())
}

/// The buffer of `obj`, C-contiguous (and writable when `write`).
pub(crate) fn buffer(obj: &Bound<'_, PyAny>, what: &str, write: bool) -> PyResult<PyUntypedBuffer> {
    let buf = PyUntypedBuffer::get(obj)?;
    if !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err(format!(
            "{what}: not a contiguous buffer"
        )));
    }
    if write && buf.readonly() {
        return Err(PyBufferError::new_err(format!(
            "{what}: a read-only buffer"
        )));
    }
    Ok(buf)
}

/// Packed int64 offsets (copied: a few bytes per piece).
fn offsets(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    let buf = PyBuffer::<i64>::get(obj)
        .map_err(|_| PyBufferError::new_err(format!("{what}: a contiguous array of int64")))?;
    if !buf.is_c_contiguous() {
        return Err(PyBufferError::new_err(format!(
            "{what}: a contiguous array of int64"
        )));
    }
    buf.to_vec(py)
}

/// The buffer of a receiver's or sender's `add`, and its pieces' offsets and size, checked
/// inside it (without `offsets`: the whole buffer as one piece).
fn pieces(
    py: Python<'_>,
    buffer_obj: &Bound<'_, PyAny>,
    offsets_obj: Option<&Bound<'_, PyAny>>,
    size: usize,
    write: bool,
) -> PyResult<(PyUntypedBuffer, Vec<i64>, usize)> {
    let buf = buffer(buffer_obj, "buffer", write)?;
    let (at, size) = match offsets_obj {
        Some(obj) => (offsets(py, obj, "offsets")?, size),
        None => (vec![0], buf.len_bytes()),
    };
    super::check_pieces("offsets", buf.len_bytes(), &at, size).map_err(PyValueError::new_err)?;
    Ok((buf, at, size))
}

/// Copy `size` bytes from `src` at `src_offsets[i]` to `dst` at `dst_offsets[i]`, for each
/// `i`, with up to `threads` threads when there are 4 MiB or more (ValueError, and nothing
/// copied, when a piece is outside its buffer).
#[pyfunction]
#[pyo3(signature = (dst, dst_offsets, src, src_offsets, size, threads = 1))]
fn copy_spans(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    dst_offsets: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    src_offsets: &Bound<'_, PyAny>,
    size: usize,
    threads: usize,
) -> PyResult<()> {
    let d = buffer(dst, "dst", true)?;
    let s = buffer(src, "src", false)?;
    let dst_at = offsets(py, dst_offsets, "dst_offsets")?;
    let src_at = offsets(py, src_offsets, "src_offsets")?;
    let dst_side = Side {
        addr: d.buf_ptr() as usize,
        len: d.len_bytes(),
        offsets: &dst_at,
    };
    let src_side = Side {
        addr: s.buf_ptr() as usize,
        len: s.len_bytes(),
        offsets: &src_at,
    };
    // SAFETY: both buffers stay exported (so alive, and not resized) until they drop below.
    py.detach(|| unsafe { copy(dst_side, src_side, size, threads) })
        .map_err(PyValueError::new_err)
}

/// Where the next bytes of a stream go: pieces of buffers (`add`) and bytes to drop
/// (`drain`), in order; `recv` fills them from a non-blocking socket.
#[pyclass(name = "Receiver", module = "kvpool_native")]
struct PyReceiver {
    inner: Receiver,
    /// The buffers the pieces are in, exported until the receiver goes.
    buffers: Vec<PyUntypedBuffer>,
}

#[pymethods]
impl PyReceiver {
    #[new]
    fn new() -> Self {
        PyReceiver {
            inner: Receiver::new(),
            buffers: Vec::new(),
        }
    }

    /// Add the pieces of `size` bytes at `offsets` (int64) of the writable `buffer`, in order.
    fn add(
        &mut self,
        py: Python<'_>,
        buffer_obj: &Bound<'_, PyAny>,
        offsets_obj: &Bound<'_, PyAny>,
        size: usize,
    ) -> PyResult<()> {
        let (buf, at, size) = pieces(py, buffer_obj, Some(offsets_obj), size, true)?;
        let base = buf.buf_ptr() as *mut u8;
        for &off in &at {
            // SAFETY: checked inside the buffer, which stays exported while the receiver is.
            unsafe { self.inner.push(base.add(off as usize), size) };
        }
        self.buffers.push(buf);
        Ok(())
    }

    /// Add `n` bytes to read and drop.
    fn drain(&mut self, n: usize) {
        self.inner.drain(n);
    }

    /// Bytes of every piece.
    #[getter]
    fn total(&self) -> u64 {
        self.inner.total()
    }

    /// Bytes received (or taken) so far.
    #[getter]
    fn received(&self) -> u64 {
        self.inner.received()
    }

    /// Every piece is filled.
    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// Consume bytes read ahead of the data; returns how many were used.
    fn take(&mut self, src: &Bound<'_, PyAny>) -> PyResult<usize> {
        let buf = buffer(src, "src", false)?;
        // SAFETY: the buffer is exported (alive, unchanged in size) for this call; the GIL is
        // held, so no Python code writes it meanwhile.
        let bytes =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        Ok(self.inner.take(bytes))
    }

    /// Receive from the non-blocking socket `fd` until every piece is filled, waiting up to
    /// `wait_s` seconds in all for it to be readable (0: return when it would block).
    /// Returns the bytes received; ConnectionError when the peer closed the connection first,
    /// OSError when the socket failed.
    #[pyo3(signature = (fd, wait_s = 0.0))]
    fn recv(&mut self, py: Python<'_>, fd: i32, wait_s: f64) -> PyResult<usize> {
        let wait = Duration::try_from_secs_f64(wait_s.max(0.0)).unwrap_or(Duration::MAX);
        let inner = &mut self.inner;
        stream_result(py.detach(|| inner.recv(fd, wait)))
    }

    /// Let go of the buffers (the receiver takes no more bytes).
    fn close(&mut self) {
        self.inner = Receiver::new();
        self.buffers.clear();
    }
}

/// A receive's or a send's outcome in Python's terms.
fn stream_result(result: Result<usize, StreamError>) -> PyResult<usize> {
    match result {
        Ok(n) => Ok(n),
        Err(StreamError::Closed) => Err(PyConnectionError::new_err("peer closed the connection")),
        Err(StreamError::Io(err)) => Err(err.into()),
    }
}

/// Where the next bytes of a stream come from: pieces of buffers (`add`), in order; `send`
/// sends them on a non-blocking socket.
#[pyclass(name = "Sender", module = "kvpool_native")]
struct PySender {
    inner: Sender,
    /// The buffers the pieces are in, exported until the sender goes.
    buffers: Vec<PyUntypedBuffer>,
}

#[pymethods]
impl PySender {
    #[new]
    fn new() -> Self {
        PySender {
            inner: Sender::new(),
            buffers: Vec::new(),
        }
    }

    /// Add the pieces of `size` bytes at `offsets` (int64) of `buffer`, in order; the whole
    /// buffer, as one piece, without `offsets`.
    #[pyo3(signature = (buffer_obj, offsets_obj = None, size = 0))]
    fn add(
        &mut self,
        py: Python<'_>,
        buffer_obj: &Bound<'_, PyAny>,
        offsets_obj: Option<&Bound<'_, PyAny>>,
        size: usize,
    ) -> PyResult<()> {
        let (buf, at, size) = pieces(py, buffer_obj, offsets_obj, size, false)?;
        let base = buf.buf_ptr() as *const u8;
        for &off in &at {
            // SAFETY: checked inside the buffer, which stays exported while the sender is.
            unsafe { self.inner.push(base.add(off as usize), size) };
        }
        self.buffers.push(buf);
        Ok(())
    }

    /// Bytes of every piece.
    #[getter]
    fn total(&self) -> u64 {
        self.inner.total()
    }

    /// Bytes sent so far.
    #[getter]
    fn sent(&self) -> u64 {
        self.inner.sent()
    }

    /// Every piece is sent.
    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// Send on the non-blocking socket `fd` until every piece is sent, waiting up to `wait_s`
    /// seconds in all for it to be writable (0: return when it would block). Returns the
    /// bytes sent; OSError when the socket failed (BrokenPipeError: the peer went away).
    #[pyo3(signature = (fd, wait_s = 0.0))]
    fn send(&mut self, py: Python<'_>, fd: i32, wait_s: f64) -> PyResult<usize> {
        let wait = Duration::try_from_secs_f64(wait_s.max(0.0)).unwrap_or(Duration::MAX);
        let inner = &mut self.inner;
        stream_result(py.detach(|| inner.send(fd, wait)))
    }

    /// Let go of the buffers (the sender sends no more bytes).
    fn close(&mut self) {
        self.inner = Sender::new();
        self.buffers.clear();
    }
}
