//! The same-node client's PUT (`ShmClient.put` in `kvpool_agent/dataplane/shm.py`), compiled:
//! the PUT_SHM request, the copy of the chain's new blocks into the mapped arena and the
//! COMMIT, in one call that holds no interpreter lock.
//!
//! A vLLM worker saves from a sender thread beside the engine's own, and the time that thread
//! holds the interpreter lock is time vLLM's main thread may wait for it between its kernels:
//! with every save sent at once, 1k-token requests without a hit were 1 to 5 points slower
//! with the exchange in Python than with this one, in the same run (`docs/vllm.md`, "The
//! same-node PUT compiled"). Here the exchange runs on the caller's blocking socket (its
//! kernel timeouts bound each wait) with the frames of `dataplane/protocol.py`. The request's
//! metadata comes packed by the caller; an error reply's metadata goes back to it unread, to
//! be raised as the Python client raises it.

#[cfg(feature = "python")]
pub mod py;

use std::io;

use crate::copy::{copy_spans, Side};
use crate::wire::msgpack::{Reader, Writer};

pub const HEADER_SIZE: usize = 32;
const MAGIC: &[u8; 4] = b"KVPX";
const VERSION: u8 = 1;
const F_RESPONSE: u16 = 0x1;
const F_ERROR: u16 = 0x2;
const F_CRC: u16 = 0x4;
pub const OP_PUT_SHM: u8 = 10;
pub const OP_COMMIT: u8 = 11;
pub const OP_ABORT: u8 = 12;
/// The most metadata a reply may carry (a reservation's ids are 4 bytes a block per pool).
pub const MAX_REPLY_META: usize = 64 << 20;

/// One pool's side of the copy: where its `[layer, block]` pieces are in the arena, and the
/// caller's contiguous `[layers, blocks, piece]` bytes of the chain's blocks `first..`.
#[derive(Debug, Clone, Copy)]
pub struct Pool {
    pub base: usize,
    pub layer_stride: usize,
    pub block_stride: usize,
    /// Bytes of one `[layer, block]` piece.
    pub piece: usize,
    pub layers: usize,
    /// Blocks in `src` (the chain's blocks `first..`).
    pub blocks: usize,
    pub src: usize,
    pub src_len: usize,
}

/// How a PUT ended (a failed socket is a [`PutError`] instead).
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// The blocks were copied and committed.
    Stored { stored: u64, resident: u64 },
    /// The agent held the whole chain already: nothing was reserved or copied.
    Held { resident: u64 },
    /// An error reply (to the PUT_SHM: nothing reserved; or to the COMMIT): its metadata.
    Refused { meta: Vec<u8> },
    /// The caller's bytes do not fit the reservation: it was aborted, nothing copied.
    Mismatch { reason: String },
}

#[derive(Debug)]
pub enum PutError {
    Io(io::Error),
    /// The agent closed the connection.
    Closed,
    /// A frame the agent should not have sent.
    Protocol(String),
}

impl From<io::Error> for PutError {
    fn from(err: io::Error) -> Self {
        PutError::Io(err)
    }
}

/// A reservation as a PUT_SHM reply gives it.
#[derive(Debug, Default)]
struct Reservation {
    store: u64,
    resident: u64,
    /// Per pool, the packed little-endian int32 ids of blocks `resident..`.
    blocks: Vec<Vec<u8>>,
}

/// Store a chain through the agent behind the connected, blocking socket `fd`: PUT_SHM with
/// `meta` (the request's packed metadata, whose `first` is `first`) as request `rid`, the
/// reserved blocks copied from each pool's `src` into the arena at `arena..arena + arena_len`,
/// then COMMIT (or ABORT, when the bytes do not fit) as request `rid + 1`.
///
/// # Safety
///
/// `arena` must be valid for writes of `arena_len` bytes and each pool's `src` for reads of
/// its `src_len` bytes for the whole call; `fd` must be a connected stream socket that
/// nothing else reads or writes meanwhile.
pub unsafe fn put(
    fd: i32,
    rid: u64,
    meta: &[u8],
    first: u64,
    pools: &[Pool],
    arena: usize,
    arena_len: usize,
) -> Result<Outcome, PutError> {
    send_frame(fd, OP_PUT_SHM, rid, meta)?;
    let (flags, reply) = read_reply(fd, rid)?;
    if flags & F_ERROR != 0 {
        return Ok(Outcome::Refused { meta: reply });
    }
    let r = reservation(&reply).map_err(PutError::Protocol)?;
    if r.store == 0 {
        return Ok(Outcome::Held {
            resident: r.resident,
        });
    }
    let end = |op: u8| -> Result<(u16, Vec<u8>), PutError> {
        let mut w = Writer::with_capacity(16);
        w.map(1);
        w.str("store");
        w.int(i128::from(r.store));
        send_frame(fd, op, rid + 1, w.bytes())?;
        read_reply(fd, rid + 1)
    };
    if let Err(reason) = copy_in(&r, first, pools, arena, arena_len) {
        end(OP_ABORT)?; // its own refusal (the reservation expired) changes nothing
        return Ok(Outcome::Mismatch { reason });
    }
    let (flags, reply) = end(OP_COMMIT)?;
    if flags & F_ERROR != 0 {
        return Ok(Outcome::Refused { meta: reply });
    }
    let (stored, resident) = committed(&reply).map_err(PutError::Protocol)?;
    Ok(Outcome::Stored { stored, resident })
}

/// Copy each pool's blocks `resident - first..` of `src` to the reserved ids, one piece per
/// layer per block; nothing is copied when a pool's bytes or ids do not fit.
unsafe fn copy_in(
    r: &Reservation,
    first: u64,
    pools: &[Pool],
    arena: usize,
    arena_len: usize,
) -> Result<(), String> {
    if r.blocks.len() != pools.len() {
        return Err(format!(
            "the reservation names {} pools, the data has {}",
            r.blocks.len(),
            pools.len()
        ));
    }
    let skip = r.resident.checked_sub(first).ok_or_else(|| {
        format!(
            "the reservation starts at block {}, before the data's {first}",
            r.resident
        )
    })? as usize;
    let mut plans = Vec::with_capacity(pools.len());
    for (i, (p, raw)) in pools.iter().zip(&r.blocks).enumerate() {
        if raw.len() % 4 != 0 {
            return Err(format!("pool {i}: {} bytes of block ids", raw.len()));
        }
        let ids: Vec<i64> = raw
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        if skip + ids.len() != p.blocks {
            return Err(format!(
                "kv[{i}]: {} blocks given, the reservation needs {} ({skip} the agent holds, {} \
                 new)",
                p.blocks,
                skip + ids.len(),
                ids.len()
            ));
        }
        if p.src_len != p.layers * p.blocks * p.piece {
            return Err(format!(
                "kv[{i}]: {} bytes, {} layers of {} blocks of {} bytes expected",
                p.src_len, p.layers, p.blocks, p.piece
            ));
        }
        let mut to = Vec::with_capacity(p.layers * ids.len());
        let mut at = Vec::with_capacity(p.layers * ids.len());
        for layer in 0..p.layers {
            for (j, &id) in ids.iter().enumerate() {
                let offset = (p.base + layer * p.layer_stride) as i64 + id * p.block_stride as i64;
                to.push(offset);
                at.push(((layer * p.blocks + skip + j) * p.piece) as i64);
            }
        }
        crate::copy::check_pieces("arena", arena_len, &to, p.piece)
            .map_err(|e| format!("pool {i}: {e}"))?;
        plans.push((to, at));
    }
    for (p, (to, at)) in pools.iter().zip(&plans) {
        let dst = Side {
            addr: arena,
            len: arena_len,
            offsets: to,
        };
        let src = Side {
            addr: p.src,
            len: p.src_len,
            offsets: at,
        };
        copy_spans(dst, src, p.piece, 1)?;
    }
    Ok(())
}

fn reservation(meta: &[u8]) -> Result<Reservation, String> {
    let mut rd = Reader::new(meta);
    let mut out = Reservation::default();
    let (mut store, mut resident) = (false, false);
    for _ in 0..rd.map()? {
        match rd.str()? {
            b"store" => (out.store, store) = (uint(&mut rd, "store")?, true),
            b"resident" => (out.resident, resident) = (uint(&mut rd, "resident")?, true),
            b"blocks" => {
                let n = rd.array()?;
                out.blocks = (0..n)
                    .map(|_| rd.bin().map(<[u8]>::to_vec))
                    .collect::<Result<_, _>>()?;
            }
            _ => rd.skip()?,
        }
    }
    if !(store && resident) {
        return Err("put_shm: the reply lacks store or resident".into());
    }
    Ok(out)
}

fn committed(meta: &[u8]) -> Result<(u64, u64), String> {
    let mut rd = Reader::new(meta);
    let (mut stored, mut resident) = (None, None);
    for _ in 0..rd.map()? {
        match rd.str()? {
            b"stored" => stored = Some(uint(&mut rd, "stored")?),
            b"resident" => resident = Some(uint(&mut rd, "resident")?),
            _ => rd.skip()?,
        }
    }
    stored
        .zip(resident)
        .ok_or_else(|| "commit: the reply lacks stored or resident".into())
}

fn uint(rd: &mut Reader<'_>, what: &str) -> Result<u64, String> {
    let v = rd.int()?;
    u64::try_from(v).map_err(|_| format!("{what}: {v} is not a count"))
}

/// One request frame: the header, then `meta` (no data).
fn send_frame(fd: i32, op: u8, rid: u64, meta: &[u8]) -> Result<(), PutError> {
    let mut frame = Vec::with_capacity(HEADER_SIZE + meta.len());
    frame.extend_from_slice(MAGIC);
    frame.push(VERSION);
    frame.push(op);
    frame.extend_from_slice(&0u16.to_le_bytes());
    frame.extend_from_slice(&rid.to_le_bytes());
    frame.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&0u64.to_le_bytes());
    frame.extend_from_slice(meta);
    let mut sent = 0;
    while sent < frame.len() {
        let left = &frame[sent..];
        // SAFETY: `left` is valid for reads of its length.
        let n = unsafe { libc::send(fd, left.as_ptr().cast(), left.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err.into());
            }
            continue;
        }
        sent += n as usize;
    }
    Ok(())
}

fn recv_exact(fd: i32, buf: &mut [u8]) -> Result<(), PutError> {
    let mut got = 0;
    while got < buf.len() {
        let left = &mut buf[got..];
        // SAFETY: `left` is valid for writes of its length.
        let n = unsafe { libc::recv(fd, left.as_mut_ptr().cast(), left.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err.into());
            }
            continue;
        }
        if n == 0 {
            return Err(PutError::Closed);
        }
        got += n as usize;
    }
    Ok(())
}

/// The reply to request `rid`: its flags and metadata (any data is read and dropped).
fn read_reply(fd: i32, rid: u64) -> Result<(u16, Vec<u8>), PutError> {
    let mut head = [0u8; HEADER_SIZE];
    recv_exact(fd, &mut head)?;
    let field = |at: usize, n: usize| {
        head[at..at + n]
            .iter()
            .rev()
            .fold(0u64, |acc, &b| acc << 8 | u64::from(b))
    };
    if &head[..4] != MAGIC || head[4] != VERSION {
        return Err(PutError::Protocol(format!(
            "frame: bad magic or version {:?}",
            &head[..5]
        )));
    }
    let flags = field(6, 2) as u16;
    if flags & !(F_RESPONSE | F_ERROR | F_CRC) != 0 || flags & F_RESPONSE == 0 {
        return Err(PutError::Protocol(format!(
            "frame: flags {flags:#x} on a reply"
        )));
    }
    let id = field(8, 8);
    if id != rid && id != 0 {
        return Err(PutError::Protocol(format!(
            "reply to request {id}, expected {rid}"
        )));
    }
    let meta_len = field(16, 4) as usize;
    if meta_len > MAX_REPLY_META {
        return Err(PutError::Protocol(format!(
            "a reply of {meta_len} bytes of metadata"
        )));
    }
    let mut meta = vec![0u8; meta_len];
    recv_exact(fd, &mut meta)?;
    let mut data = field(24, 8);
    let mut scratch = [0u8; 4096];
    while data > 0 {
        let n = data.min(scratch.len() as u64) as usize;
        recv_exact(fd, &mut scratch[..n])?;
        data -= n as u64;
    }
    Ok((flags, meta))
}

#[cfg(test)]
mod tests;
