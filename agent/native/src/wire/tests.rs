use super::msgpack::Writer;
use super::*;

fn ints(values: &[i128]) -> Vec<u8> {
    let mut w = Writer::default();
    for &v in values {
        w.int(v);
    }
    w.into_bytes()
}

#[test]
fn ints_take_msgpack_pythons_shortest_form() {
    assert_eq!(ints(&[0, 127, -1, -32]), vec![0x00, 0x7f, 0xff, 0xe0]);
    assert_eq!(ints(&[128, -33]), vec![0xcc, 0x80, 0xd0, 0xdf]);
    assert_eq!(ints(&[256, -129]), vec![0xcd, 0x01, 0x00, 0xd1, 0xff, 0x7f]);
    assert_eq!(ints(&[1 << 32])[0], 0xcf);
    assert_eq!(ints(&[u64::MAX as i128])[1..], [0xff; 8]);
    assert_eq!(ints(&[i64::MIN as i128])[0], 0xd3);
    assert_eq!(ints(&[-(1 << 31)])[0], 0xd2);
}

#[test]
fn a_named_block_goes_out_under_its_name_and_its_child_names_it_as_parent() {
    let mut enc = WireEncoder::new(2, "GPU");
    enc.name(&[5, 6], wire_hash(&[0xab; 40]));
    let stored = |key, parent, tokens: &[u64]| Event::Stored {
        key,
        parent,
        tokens: tokens.into(),
        tier: 0,
        priority: 35,
    };
    let (_, n) = enc
        .encode_batch(
            [&stored(-7, None, &[5, 6]), &stored(9, Some(-7), &[7, 8])],
            1.5,
            0,
        )
        .unwrap();
    assert_eq!(n, 2);
    assert_eq!(enc.pending_names(), 0);
    let name = wire_hash(&[0xab; 40]);
    assert_eq!(name, u64::from_be_bytes([0xab; 8]) as i128);
    assert_eq!(enc.known[&-7].wire(), name);
    assert_eq!(enc.known[&9].parent(), Some(name));
    // A move to the host tier is a removal and a store on the wire, with the tokens the move
    // brings; a priority change is none.
    let moved = Event::Updated {
        key: 9,
        tier: 1,
        priority: 35,
        tokens: Some([7, 8].into()),
    };
    let (bytes, n) = enc.encode_batch([&moved], 2.0, 0).unwrap();
    assert_eq!(n, 2);
    let token_ids = [&b"token_ids"[..], &[0x92, 7, 8]].concat();
    assert!(bytes.windows(token_ids.len()).any(|w| w == &token_ids[..]));
    assert!(enc.encode_batch([&moved], 2.0, 0).is_none());
    let gone = Event::Removed {
        key: 9,
        tier: 1,
        reason: Reason::Evicted,
    };
    assert_eq!(enc.encode_batch([&gone], 3.0, 0).unwrap().1, 1);
    assert_eq!(enc.removed, [1, 0, 0, 0]);
    assert_eq!(enc.live_blocks(), 1);
}

#[test]
fn a_move_without_tokens_withdraws_the_block() {
    let mut enc = WireEncoder::new(2, "GPU");
    let stored = Event::Stored {
        key: 4,
        parent: None,
        tokens: [1, 2].into(),
        tier: 0,
        priority: 35,
    };
    enc.encode_batch([&stored], 1.0, 0).unwrap();
    let moved = Event::Updated {
        key: 4,
        tier: 1,
        priority: 35,
        tokens: None,
    };
    assert_eq!(enc.encode_batch([&moved], 2.0, 0).unwrap().1, 1);
    assert_eq!(enc.live_blocks(), 0);
}

#[test]
fn a_known_block_keeps_both_kinds_of_hash_in_24_bytes() {
    assert_eq!(std::mem::size_of::<Known>(), 24);
    for (wire, parent) in [
        (i64::MIN as Wire, Some(u64::MAX as Wire)),
        (u64::MAX as Wire, Some(-1)),
        (0, None),
        (-5, Some(0)),
    ] {
        let known = Known::new(wire, parent, 1);
        assert_eq!(
            (known.wire(), known.parent(), known.medium),
            (wire, parent, 1)
        );
    }
}

#[test]
fn names_forget_the_oldest_past_the_bound() {
    let mut enc = WireEncoder::new(1, "CPU");
    for t in 0..(MAX_PENDING_NAMES as u64 + 3) {
        enc.name(&[t], t as i128);
    }
    assert_eq!(enc.pending_names(), MAX_PENDING_NAMES);
    assert!(enc.names.take(&[0]).is_none());
    assert_eq!(enc.names.take(&[3]), Some(3));
}

#[test]
fn names_keep_their_place_and_skip_what_was_taken() {
    let mut names = Names::default();
    names.insert(&[1, 1], 10);
    names.insert(&[2, 2], 20);
    names.insert(&[1, 1], 11); // named again: a new name, the same place
    assert_eq!(names.take(&[2, 2]), Some(20));
    names.pop_oldest(); // skips nothing: [1, 1] is the oldest
    assert_eq!(names.len(), 0);
    assert!(names.take(&[1, 1]).is_none());
    for t in 0..1000u64 {
        names.insert(&[t, t], t as i128);
        assert_eq!(names.take(&[t, t]), Some(t as i128));
    }
    assert!(names.order.len() <= 2 * names.len() + 65); // stale entries were dropped
    names.insert(&[7, 7], 7);
    names.insert(&[8, 8], 8);
    names.pop_oldest(); // past every stale entry, to the oldest live one
    assert_eq!((names.take(&[7, 7]), names.take(&[8, 8])), (None, Some(8)));
}

#[test]
fn watched_blocks_are_reported_once_when_their_last_copy_goes() {
    let mut enc = WireEncoder::new(2, "GPU");
    let stored = |key: i64| Event::Stored {
        key,
        parent: None,
        tokens: [1, 2].into(),
        tier: 0,
        priority: 35,
    };
    let removed = |key: i64| Event::Removed {
        key,
        tier: 0,
        reason: Reason::Evicted,
    };
    let moved = Event::Updated {
        key: 1,
        tier: 1,
        priority: 35,
        tokens: Some([1, 2].into()),
    };
    enc.encode_batch([&stored(1), &stored(2), &stored(3)], 1.0, 0);
    enc.watch(1);
    enc.watch(2);
    enc.watch(7); // not stored: reported only by a clear
    enc.encode_batch([&moved, &removed(3)], 2.0, 0); // a move is no removal
    assert!(enc.take_gone().is_empty());
    enc.encode_batch([&removed(1), &removed(1)], 3.0, 0);
    assert_eq!(enc.take_gone(), vec![1]);
    assert!(enc.take_gone().is_empty());
    enc.encode_batch([&Event::AllCleared], 4.0, 0);
    let mut gone = enc.take_gone();
    gone.sort();
    assert_eq!(gone, vec![2, 7]);
    assert_eq!(enc.watched_len(), 0);
}
