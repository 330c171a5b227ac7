//! The data plane's byte movers, compiled: scatter/gather copies between buffers and receives
//! from a socket straight into scattered pieces of memory (`kvpool_agent/dataplane`).
//!
//! A KV block is one piece per layer in the agent's paged arena (`[layers, blocks, ...]`), and
//! a request's blocks are wherever the allocator put them, so moving a request is thousands
//! of equal-size pieces between a contiguous buffer and scattered places. Done from Python
//! that was a memoryview (or a tensor copy) per piece; here it is a loop over two arrays of
//! byte offsets:
//!
//! - [`copy_spans`]: `size` bytes from `src + src_offsets[i]` to `dst + dst_offsets[i]` for
//!   every `i` (the same-node path's writes into and reads out of a mapped arena), optionally
//!   shared with helper threads that take chunks of pieces as they go (so a helper that never
//!   gets a core costs nothing but its start);
//! - [`Receiver`]: the pieces a request's data goes to, in wire order (or drained: bytes of
//!   blocks the cache holds already), filled by `readv` on a non-blocking socket, waiting
//!   with `poll` for at most a given time (the transfer port's PUT);
//! - [`Sender`]: the same the other way, the pieces a reply's data comes from, sent by
//!   `sendmsg` (the transfer port's GET).
//!
//! Offsets are checked against the buffers' lengths before any byte moves. The memory is
//! addressed through raw pointers only: a mapped arena is shared with other processes, which
//! write it as they please, so no Rust reference to it is ever formed.

#[cfg(feature = "python")]
pub mod py;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Most buffers one `readv` is given (Linux's `IOV_MAX`).
pub const IOV_MAX: usize = 1024;
/// Most bytes one `readv` is offered (more than a socket buffer holds).
pub const BATCH_BYTES: usize = 8 << 20;
/// Where drained bytes are received (overwritten by each receive).
pub const SCRATCH_BYTES: usize = 1 << 20;
/// Below this many bytes a copy stays on the calling thread (starting a helper costs tens of
/// microseconds).
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;
/// Bytes a copying thread takes at a time.
const CHUNK_BYTES: usize = 512 << 10;

/// Check that `size`-byte pieces at `offsets` lie inside a buffer of `len` bytes.
pub fn check_pieces(what: &str, len: usize, offsets: &[i64], size: usize) -> Result<(), String> {
    for (i, &at) in offsets.iter().enumerate() {
        let inside = usize::try_from(at)
            .ok()
            .and_then(|at| at.checked_add(size))
            .is_some_and(|end| end <= len);
        if !inside {
            return Err(format!(
                "{what}[{i}]: {size} bytes at offset {at} are outside the buffer ({len} bytes)"
            ));
        }
    }
    Ok(())
}

/// A pointer that may cross threads (the copy's pieces are checked before it starts).
#[derive(Clone, Copy)]
struct Addr(usize);

/// One side of a copy: a buffer (its address and length) and the offsets of the pieces in it.
#[derive(Debug, Clone, Copy)]
pub struct Side<'a> {
    pub addr: usize,
    pub len: usize,
    pub offsets: &'a [i64],
}

/// Copy `size` bytes from `src.addr + src.offsets[i]` to `dst.addr + dst.offsets[i]` for each
/// `i`, with up to `threads` threads (the caller's included) when there are at least
/// [`PARALLEL_MIN_BYTES`] to move. Pieces are checked against the buffers' lengths first:
/// nothing is copied when one is outside its buffer. A piece that overlaps its own source is
/// copied as `memmove` does; pieces whose destinations overlap each other end with the bytes
/// of one of them.
///
/// # Safety
///
/// `dst.addr` must be valid for writes of `dst.len` bytes and `src.addr` for reads of
/// `src.len` bytes for the whole call.
pub unsafe fn copy_spans(
    dst: Side<'_>,
    src: Side<'_>,
    size: usize,
    threads: usize,
) -> Result<(), String> {
    let (dst_offsets, src_offsets) = (dst.offsets, src.offsets);
    if dst_offsets.len() != src_offsets.len() {
        return Err(format!(
            "{} destination offsets for {} source offsets",
            dst_offsets.len(),
            src_offsets.len()
        ));
    }
    check_pieces("dst_offsets", dst.len, dst_offsets, size)?;
    check_pieces("src_offsets", src.len, src_offsets, size)?;
    let n = dst_offsets.len();
    if n == 0 || size == 0 {
        return Ok(());
    }
    let total = n.saturating_mul(size);
    let threads = threads.clamp(1, 64);
    if threads == 1 || total < PARALLEL_MIN_BYTES {
        copy_range(
            Addr(dst.addr),
            dst_offsets,
            Addr(src.addr),
            src_offsets,
            size,
        );
        return Ok(());
    }
    let per_chunk = (CHUNK_BYTES / size).max(1);
    let chunks = n.div_ceil(per_chunk);
    let helpers = (threads - 1).min(chunks - 1);
    let next = AtomicUsize::new(0);
    let (d, s) = (Addr(dst.addr), Addr(src.addr));
    let work = || loop {
        let c = next.fetch_add(1, Ordering::Relaxed);
        if c >= chunks {
            break;
        }
        let range = c * per_chunk..((c + 1) * per_chunk).min(n);
        copy_range(d, &dst_offsets[range.clone()], s, &src_offsets[range], size);
    };
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(work);
        }
        work();
    });
    Ok(())
}

/// The copies themselves (offsets checked by the caller).
fn copy_range(dst: Addr, dst_offsets: &[i64], src: Addr, src_offsets: &[i64], size: usize) {
    let stream = dst_offsets.len().saturating_mul(size) >= STREAM_MIN_BYTES;
    for (&d, &s) in dst_offsets.iter().zip(src_offsets) {
        // SAFETY: `copy_spans` checked both pieces against their buffers.
        unsafe {
            let from = (src.0 as *const u8).add(s as usize);
            let to = (dst.0 as *mut u8).add(d as usize);
            if stream {
                copy_streaming(to, from, size);
            } else {
                std::ptr::copy(from, to, size);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: SSE2 is part of x86_64. Orders the streaming stores before what follows.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

/// Copies of at least this many bytes in all bypass the cache (as `memcpy` does for large
/// copies): the bytes go to memory without each destination line being read first, which
/// about halves the memory traffic of a copy into memory that is not in cache.
pub const STREAM_MIN_BYTES: usize = 1 << 20;

/// `len` bytes from `src` to `dst` with non-temporal stores (x86_64; elsewhere `memmove`).
///
/// # Safety
///
/// As `std::ptr::copy`.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    let overlap = (src as usize) < (dst as usize + len) && (dst as usize) < (src as usize + len);
    if overlap || len < 256 {
        std::ptr::copy(src, dst, len);
        return;
    }
    let head = dst.align_offset(32);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let body = (len - head) & !127;
    if std::is_x86_feature_detected!("avx") {
        stream_avx(dst.add(head), src.add(head), body);
    } else {
        stream_sse2(dst.add(head), src.add(head), body);
    }
    let done = head + body;
    std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
}

/// `len` (a multiple of 128) bytes to 32-byte aligned `dst`, streaming.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn stream_avx(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let mut i = 0;
    while i < len {
        let s = src.add(i) as *const __m256i;
        let d = dst.add(i) as *mut __m256i;
        let (a, b, c, e) = (
            _mm256_loadu_si256(s),
            _mm256_loadu_si256(s.add(1)),
            _mm256_loadu_si256(s.add(2)),
            _mm256_loadu_si256(s.add(3)),
        );
        _mm256_stream_si256(d, a);
        _mm256_stream_si256(d.add(1), b);
        _mm256_stream_si256(d.add(2), c);
        _mm256_stream_si256(d.add(3), e);
        i += 128;
    }
}

/// `len` (a multiple of 128) bytes to 16-byte aligned `dst`, streaming.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let mut i = 0;
    while i < len {
        let s = src.add(i) as *const __m128i;
        let d = dst.add(i) as *mut __m128i;
        for k in 0..8 {
            _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
        }
        i += 128;
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    std::ptr::copy(src, dst, len);
}

/// One piece of a stream: `len` bytes at `addr`, or (receives only) drained when `addr` is
/// `None`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    addr: Option<usize>,
    len: usize,
}

/// The pieces a stream's bytes come from or go to, in order, and how far it has got: the
/// cursor [`Receiver`] and [`Sender`] share.
#[derive(Debug, Default)]
struct Cursor {
    pieces: Vec<Piece>,
    i: usize,
    off: usize,
    total: u64,
    moved: u64,
}

impl Cursor {
    fn push(&mut self, addr: Option<usize>, len: usize) {
        if len > 0 {
            self.pieces.push(Piece { addr, len });
            self.total += len as u64;
        }
    }

    fn done(&self) -> bool {
        self.i >= self.pieces.len()
    }

    fn advance(&mut self, mut n: usize) {
        self.moved += n as u64;
        while n > 0 {
            let left = self.pieces[self.i].len - self.off;
            if n >= left {
                n -= left;
                self.i += 1;
                self.off = 0;
            } else {
                self.off += n;
                n = 0;
            }
        }
    }

    /// The buffers of the next system call: the pieces from the cursor on, drains mapped onto
    /// `scratch` (of `SCRATCH_BYTES`; a drain ends the batch where it is longer).
    fn batch(&self, iov: &mut Vec<libc::iovec>, scratch: *mut u8) {
        iov.clear();
        let mut bytes = 0;
        let mut k = self.i;
        while k < self.pieces.len() && iov.len() < IOV_MAX && bytes < BATCH_BYTES {
            let piece = self.pieces[k];
            let start = if k == self.i { self.off } else { 0 };
            let len = piece.len - start;
            let (base, len) = match piece.addr {
                // SAFETY: inside the piece (the contract of `push` on both ends).
                Some(addr) => (unsafe { (addr as *mut u8).add(start) }, len),
                None => (scratch, len.min(SCRATCH_BYTES)),
            };
            iov.push(libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            });
            bytes += len;
            if piece.addr.is_none() && len < piece.len - start {
                break; // the rest of a long drain goes in the next call
            }
            k += 1;
        }
    }

    /// Move the stream through `fd` with `call` (one `readv` or `sendmsg` of the batch) until
    /// every piece is done, waiting for `events` for at most `wait` in all (`Duration::ZERO`:
    /// return as soon as it would block). Returns the bytes moved by this call.
    fn run(
        &mut self,
        fd: i32,
        events: libc::c_short,
        wait: Duration,
        scratch: *mut u8,
        mut call: impl FnMut(&[libc::iovec]) -> isize,
    ) -> Result<usize, StreamError> {
        let deadline = Instant::now() + wait;
        let mut got = 0;
        let mut iov = Vec::with_capacity(IOV_MAX);
        while !self.done() {
            self.batch(&mut iov, scratch);
            let n = call(&iov);
            if n > 0 {
                self.advance(n as usize);
                got += n as usize;
                continue;
            }
            if n == 0 {
                return Err(StreamError::Closed);
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || !wait_ready(fd, events, left)? {
                        return Ok(got);
                    }
                }
                _ => return Err(StreamError::Io(err)),
            }
        }
        Ok(got)
    }
}

/// Why a receive or a send stopped short.
#[derive(Debug)]
pub enum StreamError {
    /// The peer closed the connection (end of stream before the last byte).
    Closed,
    Io(io::Error),
}

/// The pieces a stream's next bytes go to, in order, and how far they are filled.
#[derive(Debug, Default)]
pub struct Receiver {
    cursor: Cursor,
    scratch: Vec<u8>,
}

impl Receiver {
    pub fn new() -> Receiver {
        Receiver::default()
    }

    /// Add `len` bytes to be written at `addr` (after every piece added before).
    ///
    /// # Safety
    ///
    /// `addr` must be valid for writes of `len` bytes until the receiver is dropped or done.
    pub unsafe fn push(&mut self, addr: *mut u8, len: usize) {
        self.cursor.push(Some(addr as usize), len);
    }

    /// Add `len` bytes to be read and dropped.
    pub fn drain(&mut self, len: usize) {
        if len > 0 && self.scratch.is_empty() {
            self.scratch = vec![0; SCRATCH_BYTES];
        }
        self.cursor.push(None, len);
    }

    /// Every byte of every piece.
    pub fn total(&self) -> u64 {
        self.cursor.total
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.cursor.moved
    }

    pub fn done(&self) -> bool {
        self.cursor.done()
    }

    /// Consume bytes read ahead of the data (with the frame's header); returns how many were
    /// used (all of `src`, or up to the last piece).
    pub fn take(&mut self, src: &[u8]) -> usize {
        let mut used = 0;
        while used < src.len() && !self.done() {
            let piece = self.cursor.pieces[self.cursor.i];
            let k = (piece.len - self.cursor.off).min(src.len() - used);
            if let Some(addr) = piece.addr {
                // SAFETY: `push`'s contract: the piece is writable; `k` stays inside it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr().add(used),
                        (addr as *mut u8).add(self.cursor.off),
                        k,
                    );
                }
            }
            used += k;
            self.cursor.advance(k);
        }
        used
    }

    /// Receive from the non-blocking socket `fd` until every piece is filled, waiting for it
    /// to become readable for at most `wait` in all (`Duration::ZERO`: return as soon as it
    /// would block). Returns the bytes received by this call.
    pub fn recv(&mut self, fd: i32, wait: Duration) -> Result<usize, StreamError> {
        let scratch = self.scratch.as_mut_ptr();
        self.cursor.run(fd, libc::POLLIN, wait, scratch, |iov| {
            // SAFETY: every iovec is inside a writable piece or the scratch buffer.
            unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as libc::c_int) }
        })
    }
}

/// The pieces a stream's next bytes come from, in order (a GET's reply: its header, then the
/// blocks' pieces where they lie in the arena), and how far they are sent.
#[derive(Debug, Default)]
pub struct Sender {
    cursor: Cursor,
}

impl Sender {
    pub fn new() -> Sender {
        Sender::default()
    }

    /// Add `len` bytes at `addr` to send (after every piece added before).
    ///
    /// # Safety
    ///
    /// `addr` must be valid for reads of `len` bytes until the sender is dropped or done.
    pub unsafe fn push(&mut self, addr: *const u8, len: usize) {
        self.cursor.push(Some(addr as usize), len);
    }

    /// Every byte of every piece.
    pub fn total(&self) -> u64 {
        self.cursor.total
    }

    /// Bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.cursor.moved
    }

    pub fn done(&self) -> bool {
        self.cursor.done()
    }

    /// Send on the non-blocking socket `fd` until every piece is sent, waiting for it to
    /// become writable for at most `wait` in all (`Duration::ZERO`: return as soon as it would
    /// block). Returns the bytes sent by this call. A peer that went away is an error
    /// (`EPIPE`, never a signal: `MSG_NOSIGNAL`).
    pub fn send(&mut self, fd: i32, wait: Duration) -> Result<usize, StreamError> {
        self.cursor
            .run(fd, libc::POLLOUT, wait, std::ptr::null_mut(), |iov| {
                // SAFETY: a zeroed msghdr is valid; every iovec is inside a readable piece.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = iov.len() as _;
                // A batch is never empty, so 0 never comes back (`run` would read it as
                // the peer gone).
                unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) }
            })
    }
}

/// Wait up to `left` for `fd` to have `events` (or be closed, or failed): whether it has.
fn wait_ready(fd: i32, events: libc::c_short, left: Duration) -> Result<bool, StreamError> {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut pfd, 1, ms) };
    if r < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(true); // try again: the next call says what is there
        }
        return Err(StreamError::Io(err));
    }
    Ok(r > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::io::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// Bytes that do not repeat (a piece in the wrong place shows).
    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed as u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn copy(
        dst: &mut [u8],
        d: &[i64],
        src: &[u8],
        s: &[i64],
        size: usize,
        threads: usize,
    ) -> Result<(), String> {
        let dst = Side {
            addr: dst.as_mut_ptr() as usize,
            len: dst.len(),
            offsets: d,
        };
        let src = Side {
            addr: src.as_ptr() as usize,
            len: src.len(),
            offsets: s,
        };
        unsafe { copy_spans(dst, src, size, threads) }
    }

    #[test]
    fn scatters_and_gathers() {
        let src = pattern(64, 7);
        let mut dst = vec![0u8; 128];
        copy(&mut dst, &[96, 0, 40], &src, &[0, 16, 32], 16, 1).unwrap();
        assert_eq!(&dst[96..112], &src[0..16]);
        assert_eq!(&dst[0..16], &src[16..32]);
        assert_eq!(&dst[40..56], &src[32..48]);
        assert!(dst[16..40].iter().all(|&b| b == 0));
    }

    #[test]
    fn refuses_pieces_outside_the_buffers() {
        let src = pattern(64, 1);
        let mut dst = vec![0u8; 64];
        for (d, s) in [(49, 0), (0, 49), (-1, 0), (0, -16), (i64::MAX, 0)] {
            let err = copy(&mut dst, &[0, d], &src, &[0, s], 16, 1).unwrap_err();
            assert!(err.contains("outside the buffer"), "{err}");
        }
        assert!(dst.iter().all(|&b| b == 0), "nothing copied");
        assert!(copy(&mut dst, &[0], &src, &[0, 16], 16, 1).is_err());
        copy(&mut dst, &[48], &src, &[48], 16, 1).unwrap(); // the last 16 bytes
    }

    #[test]
    fn threads_copy_the_same_bytes() {
        let size = 8 << 10;
        let n = 1024; // 8 MiB: past PARALLEL_MIN_BYTES
        let src = pattern(n * size, 3);
        let s: Vec<i64> = (0..n as i64).map(|i| i * size as i64).collect();
        let d: Vec<i64> = (0..n as i64)
            .map(|i| ((i * 37) % n as i64) * size as i64)
            .collect();
        let mut one = vec![0u8; n * size];
        let mut four = vec![0u8; n * size];
        copy(&mut one, &d, &src, &s, size, 1).unwrap();
        copy(&mut four, &d, &src, &s, size, 4).unwrap();
        assert!(one == four);
        assert_eq!(&one[37 * size..38 * size], &src[size..2 * size]);
    }

    #[test]
    fn receives_pieces_and_drains_in_order() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        let data = pattern(3 * SCRATCH_BYTES, 9);
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 2 * SCRATCH_BYTES];
        let mut r = Receiver::new();
        unsafe {
            r.push(a.as_mut_ptr(), 40);
            r.drain(SCRATCH_BYTES + 7 - 40); // longer than the scratch buffer
            r.push(b.as_mut_ptr().add(10), 2 * SCRATCH_BYTES - 24);
            r.push(a.as_mut_ptr().add(60), 17);
        }
        assert_eq!(r.total(), 3 * SCRATCH_BYTES as u64);
        // read ahead first
        assert_eq!(r.take(&data[..30]), 30);
        let writer = {
            let data = data.clone();
            std::thread::spawn(move || tx.write_all(&data[30..]).unwrap())
        };
        while !r.done() {
            r.recv(rx.as_raw_fd(), Duration::from_millis(100)).unwrap();
        }
        writer.join().unwrap();
        assert_eq!(r.received(), 3 * SCRATCH_BYTES as u64);
        assert_eq!(&a[..40], &data[..40]);
        let at = SCRATCH_BYTES + 7;
        assert!(b[10..2 * SCRATCH_BYTES - 14] == data[at..3 * SCRATCH_BYTES - 17]);
        assert_eq!(&a[60..77], &data[3 * SCRATCH_BYTES - 17..]);
        assert!(a[40..60].iter().all(|&x| x == 0) && b[..10].iter().all(|&x| x == 0));
        assert!(b[2 * SCRATCH_BYTES - 14..].iter().all(|&x| x == 0));
    }

    #[test]
    fn would_block_and_closed() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; 64];
        let mut r = Receiver::new();
        unsafe { r.push(buf.as_mut_ptr(), 64) };
        assert_eq!(r.recv(rx.as_raw_fd(), Duration::ZERO).unwrap(), 0);
        tx.write_all(&[5; 10]).unwrap();
        assert_eq!(
            r.recv(rx.as_raw_fd(), Duration::from_millis(20)).unwrap(),
            10
        );
        assert!(!r.done());
        assert_eq!(r.take(&[6; 100]), 54); // the rest, read ahead
        assert!(r.done());
        assert_eq!(&buf[..10], &[5; 10]);
        assert_eq!(&buf[10..], &[6; 54]);
        let mut r = Receiver::new();
        unsafe { r.push(buf.as_mut_ptr(), 64) };
        tx.write_all(&[1; 3]).unwrap();
        drop(tx);
        assert!(matches!(
            r.recv(rx.as_raw_fd(), Duration::from_millis(20)),
            Err(StreamError::Closed)
        ));
        assert_eq!(r.received(), 3);
    }

    #[test]
    fn sends_pieces_in_order_and_meets_a_gone_peer() {
        let (tx, mut rx) = UnixStream::pair().unwrap();
        tx.set_nonblocking(true).unwrap();
        let data = pattern(3 * SCRATCH_BYTES, 4);
        let head = [7u8; 5];
        let mut s = Sender::new();
        unsafe {
            s.push(head.as_ptr(), head.len());
            s.push(data.as_ptr().add(2 * SCRATCH_BYTES), SCRATCH_BYTES);
            s.push(data.as_ptr(), 0); // an empty piece is no piece
            s.push(data.as_ptr().add(10), 2 * SCRATCH_BYTES - 10);
        }
        assert_eq!(s.total(), (head.len() + 3 * SCRATCH_BYTES - 10) as u64);
        // Nobody reads yet: a send that may not wait stops where the socket is full.
        let first = s.send(tx.as_raw_fd(), Duration::ZERO).unwrap();
        assert!(first > 0 && !s.done());
        let total = s.total() as usize;
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; total];
            std::io::Read::read_exact(&mut rx, &mut got).unwrap();
            (got, rx)
        });
        while !s.done() {
            s.send(tx.as_raw_fd(), Duration::from_millis(100)).unwrap();
        }
        assert_eq!(s.sent(), s.total());
        let (got, rx) = reader.join().unwrap();
        let mut want = head.to_vec();
        want.extend_from_slice(&data[2 * SCRATCH_BYTES..]);
        want.extend_from_slice(&data[10..2 * SCRATCH_BYTES]);
        assert!(got == want);
        drop(rx);
        let mut s = Sender::new();
        unsafe { s.push(data.as_ptr(), 64) };
        match s.send(tx.as_raw_fd(), Duration::from_millis(20)) {
            Err(StreamError::Io(err)) => assert_eq!(err.kind(), io::ErrorKind::BrokenPipe),
            other => panic!("a send to a closed peer gave {other:?}"),
        }
    }
}
