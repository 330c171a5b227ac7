use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread;

use super::*;

/// A frame as the agent writes it: the header, then `meta`.
fn reply(op: u8, rid: u64, flags: u16, meta: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(MAGIC);
    f.push(VERSION);
    f.push(op);
    f.extend_from_slice(&(flags | F_RESPONSE).to_le_bytes());
    f.extend_from_slice(&rid.to_le_bytes());
    f.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    f.extend_from_slice(&[0; 12]);
    f.extend_from_slice(meta);
    f
}

/// The next request on `sock`: its op, id and metadata.
fn request(sock: &mut UnixStream) -> (u8, u64, Vec<u8>) {
    let mut head = [0u8; HEADER_SIZE];
    sock.read_exact(&mut head).unwrap();
    assert_eq!(&head[..4], MAGIC);
    let rid = u64::from_le_bytes(head[8..16].try_into().unwrap());
    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let mut meta = vec![0; len];
    sock.read_exact(&mut meta).unwrap();
    (head[5], rid, meta)
}

fn reserved(store: u64, resident: u64, ids: &[&[i32]]) -> Vec<u8> {
    let mut w = Writer::default();
    w.map(4);
    w.str("store");
    w.int(store.into());
    w.str("resident");
    w.int(resident.into());
    w.str("blocks");
    w.array(ids.len());
    for pool in ids {
        let raw: Vec<u8> = pool.iter().flat_map(|i| i.to_le_bytes()).collect();
        w.raw(&[0xc4, raw.len() as u8]);
        w.raw(&raw);
    }
    w.str("ttl");
    w.float(30.0);
    w.into_bytes()
}

fn stored(stored: u64, resident: u64) -> Vec<u8> {
    let mut w = Writer::default();
    w.map(2);
    w.str("stored");
    w.int(stored.into());
    w.str("resident");
    w.int(resident.into());
    w.into_bytes()
}

/// A fake agent on the other end of a socket pair: it answers each request in turn with the
/// given replies, and returns the requests it saw.
fn agent(
    mut sock: UnixStream,
    replies: Vec<Vec<u8>>,
) -> thread::JoinHandle<Vec<(u8, u64, Vec<u8>)>> {
    thread::spawn(move || {
        let mut seen = Vec::new();
        for meta in replies {
            let (op, rid, body) = request(&mut sock);
            let flags = if meta.first() == Some(&0xff) {
                F_ERROR
            } else {
                0
            };
            let meta = if flags == F_ERROR {
                meta[1..].to_vec()
            } else {
                meta
            };
            sock.write_all(&reply(op, rid, flags, &meta)).unwrap();
            seen.push((op, rid, body));
        }
        seen
    })
}

/// A pool of 2 layers, 8 arena blocks, pieces of 4 bytes (layer stride 32, block stride 4).
fn pool(src: &[u8], blocks: usize) -> Pool {
    Pool {
        base: 0,
        layer_stride: 32,
        block_stride: 4,
        piece: 4,
        layers: 2,
        blocks,
        src: src.as_ptr() as usize,
        src_len: src.len(),
    }
}

#[test]
fn stores_the_new_blocks_where_the_agent_reserved_them() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    // The chain's blocks 1..4 (first = 1); the agent holds block 1 and reserves 2, 3 at 6, 2.
    let src: Vec<u8> = (0..24).collect(); // [2 layers, 3 blocks, 4 bytes]
    let fake = agent(theirs, vec![reserved(9, 2, &[&[6, 2]]), stored(2, 2)]);
    let mut arena = vec![0u8; 64];
    let out = unsafe {
        put(
            ours.as_raw_fd(),
            5,
            b"\x80",
            1,
            &[pool(&src, 3)],
            arena.as_mut_ptr() as usize,
            64,
        )
    };
    assert_eq!(
        out.unwrap(),
        Outcome::Stored {
            stored: 2,
            resident: 2
        }
    );
    let seen = fake.join().unwrap();
    assert_eq!(seen[0], (OP_PUT_SHM, 5, b"\x80".to_vec()));
    assert_eq!(seen[1].0, OP_COMMIT);
    assert_eq!(seen[1].1, 6);
    assert_eq!(seen[1].2, b"\x81\xa5store\x09");
    // layer 0: data blocks 1, 2 (bytes 4..12) to ids 6, 2; layer 1: bytes 16..24.
    assert_eq!(&arena[24..28], &src[4..8]);
    assert_eq!(&arena[8..12], &src[8..12]);
    assert_eq!(&arena[32 + 24..32 + 28], &src[16..20]);
    assert_eq!(&arena[32 + 8..32 + 12], &src[20..24]);
    let written = [8..12, 24..28, 40..44, 56..60];
    for (i, b) in arena.iter().enumerate() {
        if !written.iter().any(|r| r.contains(&i)) {
            assert_eq!(*b, 0, "byte {i} was written");
        }
    }
}

#[test]
fn a_held_chain_and_a_refusal_copy_nothing() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let mut refusal = vec![0xff];
    refusal.extend_from_slice(b"\x81\xa6status\xcd\x01\x93");
    let fake = agent(theirs, vec![reserved(0, 4, &[]), refusal]);
    let src = vec![1u8; 32];
    let mut arena = vec![0u8; 64];
    let (fd, at) = (ours.as_raw_fd(), arena.as_mut_ptr() as usize);
    let held = unsafe { put(fd, 1, b"\x80", 0, &[pool(&src, 4)], at, 64) };
    assert_eq!(held.unwrap(), Outcome::Held { resident: 4 });
    let refused = unsafe { put(fd, 2, b"\x80", 0, &[pool(&src, 4)], at, 64) };
    assert_eq!(
        refused.unwrap(),
        Outcome::Refused {
            meta: b"\x81\xa6status\xcd\x01\x93".to_vec()
        }
    );
    assert_eq!(fake.join().unwrap().len(), 2);
    assert!(arena.iter().all(|&b| b == 0));
}

#[test]
fn data_that_does_not_fit_the_reservation_is_aborted() {
    for ids in [&[1, 2, 3][..], &[1, 9][..]] {
        // three ids for two blocks of data; an id past the arena's 8 blocks
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fake = agent(theirs, vec![reserved(3, 0, &[ids]), b"\x80".to_vec()]);
        let src = vec![1u8; 16];
        let mut arena = vec![0u8; 64];
        let out = unsafe {
            put(
                ours.as_raw_fd(),
                1,
                b"\x80",
                0,
                &[pool(&src, 2)],
                arena.as_mut_ptr() as usize,
                64,
            )
        };
        assert!(matches!(out.unwrap(), Outcome::Mismatch { .. }));
        let seen = fake.join().unwrap();
        assert_eq!(seen[1].0, OP_ABORT);
        assert!(arena.iter().all(|&b| b == 0));
    }
}

#[test]
fn a_closed_or_confused_agent_is_an_error() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    drop(theirs);
    let src = vec![0u8; 16];
    let mut arena = vec![0u8; 64];
    let at = arena.as_mut_ptr() as usize;
    let out = unsafe { put(ours.as_raw_fd(), 1, b"\x80", 0, &[pool(&src, 2)], at, 64) };
    assert!(matches!(out, Err(PutError::Closed) | Err(PutError::Io(_))));

    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let fake = thread::spawn(move || {
        let (op, rid, _) = request(&mut theirs);
        theirs.write_all(&reply(op, rid + 7, 0, b"\x80")).unwrap();
    });
    let out = unsafe { put(ours.as_raw_fd(), 1, b"\x80", 0, &[pool(&src, 2)], at, 64) };
    assert!(matches!(out, Err(PutError::Protocol(ref m)) if m.contains("expected 1")));
    fake.join().unwrap();
}

/// An int of each msgpack form, and each form's ends.
const INTS: [i128; 10] = [
    0,
    127,
    -1,
    -32,
    200,
    70_000,
    5_000_000_000,
    -200,
    -70_000,
    i64::MIN as i128,
];

#[test]
fn the_reader_takes_every_int_form_and_skips_what_it_does_not_know() {
    let mut w = Writer::default();
    for v in INTS {
        w.int(v);
    }
    w.map(2);
    w.str("a");
    w.array(2);
    w.float(1.5);
    w.nil();
    w.str("b");
    w.str("x");
    let bytes = w.into_bytes();
    let mut rd = Reader::new(&bytes);
    for v in INTS {
        assert_eq!(rd.int().unwrap(), v);
    }
    rd.skip().unwrap();
    assert!(rd.done());
    assert!(Reader::new(&[0x92, 0x01]).skip().is_err()); // an array short of a member
    assert!(Reader::new(&[0xc4, 0x05, 0x00]).bin().is_err()); // a bin past the end
    let nested = |depth: usize| [vec![0x91u8; depth], vec![0x00]].concat();
    assert!(Reader::new(&nested(10)).skip().is_ok());
    let err = Reader::new(&nested(40)).skip().unwrap_err();
    assert!(err.contains("deep"), "{err}");
}
