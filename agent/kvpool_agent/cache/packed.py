"""Token blocks as the radix tree keeps them: a chained int key, and the tokens packed.

A tuple of Python ints costs 8 B a slot plus 28 B for each int past 256 (about 20 KB for a
512-token block), and the tree only needs a full block's tokens to confirm a match and to
measure a partial one. So children are found by ``block_key`` (an int, the node's key) and
a node keeps its tokens packed at 4 B each (``pack``): the key picks the candidate, the
packed tokens confirm it, so a key collision is a miss, never another block's KV (and a
block whose key a sibling already holds stays private to its sequence instead of being
stored).

The packed form is canonical, so comparing two packed blocks compares their tokens: native
``uint32`` bytes when every token fits in 32 bits, else (token ids past 2**32, which no
tokenizer emits) the plain tuple. Bytes never equal a tuple, and neither form is ever built
from tokens that fit the other.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final, cast

Packed = bytes | tuple[int, ...]
"""A block's tokens: ``uint32`` bytes, or a tuple when some token needs more bits."""

_CODE: Final = "I"
assert array(_CODE).itemsize == 4, "the packed form assumes a 4-byte C unsigned int"


def block_key(parent_key: int, tokens: tuple[int, ...]) -> int:
    """The chained key of the block ``tokens`` below the node keyed ``parent_key``.

    Python's tuple hash, as before packing: events, ghosts, policies and the miss-ratio
    curve see the same keys. Not collision-proof, hence ``pack`` beside it."""
    return hash((parent_key, tokens))


def pack(tokens: Sequence[int]) -> Packed:
    """The canonical packed form of a block's (non-negative) tokens."""
    try:
        return array(_CODE, tokens).tobytes()
    except OverflowError:
        return tuple(tokens)


def pack_all(tokens: list[int]) -> bytes | None:
    """All of ``tokens`` (ints) packed, or None when some is outside ``[0, 2**32)``: as a
    validation, twice as fast as ``min(tokens) >= 0``, and the packed prompt then serves
    every block of it (``slice_blocks``) without packing them one by one."""
    try:
        return array(_CODE, tokens).tobytes()
    except OverflowError:
        return None


class PackedTokens:
    """A prompt's tokens already packed as ``pack_all`` packs them (``uint32``, 4 bytes each,
    in this machine's order; the compiled core writes them little-endian, as its
    ``pack_tokens`` does: both take a little-endian machine, x86-64 or arm64), made by a
    caller whose tokens fit 32 bits by construction: the data plane's synthetic tokens
    (``dataplane.keys.packed_chain_tokens``). The engine takes them as they are, with no
    Python int per token and no check, where a list would be packed again; ``tolist`` is for
    the Python core and for the few tokens a caller reads back."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % 4:
            raise ValueError(f"packed tokens: {len(data)} bytes, not a whole number of tokens")
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // 4

    def __getitem__(self, index: slice) -> PackedTokens:
        """Tokens ``index`` (a slice of step 1), still packed."""
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("packed tokens: only slices of step 1")
        return PackedTokens(self.data[4 * start : 4 * max(start, stop)])

    def tolist(self) -> list[int]:
        return array(_CODE, self.data).tolist()


def slice_blocks(packed: bytes, first: int, stop: int, tpb: int) -> list[Packed]:
    """Blocks ``first .. stop - 1`` of packed tokens: ``pack_blocks`` of them, by slicing."""
    step = 4 * tpb
    return [packed[i : i + step] for i in range(first * step, stop * step, step)]


def pack_blocks(tokens: list[int], tpb: int) -> list[Packed]:
    """``pack`` of each ``tpb``-token block of ``tokens`` (a whole number of blocks): one
    conversion for them all when every token fits, as is the rule."""
    whole = pack(tokens)
    if isinstance(whole, bytes):
        step = 4 * tpb
        return [whole[i : i + step] for i in range(0, len(whole), step)]
    return [pack(tokens[i : i + tpb]) for i in range(0, len(tokens), tpb)]


def unpack(packed: Packed) -> tuple[int, ...]:
    """The tokens of a packed block."""
    if isinstance(packed, tuple):
        return packed
    return tuple(memoryview(packed).cast(_CODE))


def indexable(packed: Packed) -> Sequence[int]:
    """The tokens of a packed block, indexable without unpacking them all."""
    if isinstance(packed, tuple):
        return packed
    return memoryview(packed).cast(_CODE)


def first_token(packed: Packed) -> int:
    """The first token of a (non-empty) packed block."""
    return indexable(packed)[0]


def shared_prefix(packed: Packed, rest: Sequence[int], head: Packed | None = None) -> int:
    """How many leading tokens of ``rest`` the packed block starts with.

    ``head`` (``pack(rest[:1])``), given when many blocks are measured against one ``rest``,
    turns most of them down with one bytes compare instead of a view of their tokens."""
    if isinstance(head, bytes) and isinstance(packed, bytes) and not packed.startswith(head):
        return 0
    tokens = indexable(packed)
    n = min(len(tokens), len(rest))
    m = 0
    while m < n and tokens[m] == rest[m]:
        m += 1
    return m


def confirmed(
    blocks: list[Packed], tokens: list[int], tpb: int, packed: bytes | None = None
) -> int:
    """How many of ``blocks`` (packed, found by key) hold the successive ``tpb``-token
    blocks of ``tokens``: all of them unless some key collided. One pack (none when
    ``packed``, the packed ``tokens``, is given) and one compare for the lot in the common
    case, block by block only to find where a mismatch starts."""
    n = len(blocks)
    whole = pack(tokens[: n * tpb]) if packed is None else packed
    if isinstance(whole, bytes):
        try:
            if whole.startswith(b"".join(cast(list[bytes], blocks))):
                return n
        except TypeError:
            pass  # a tuple block (tokens past 32 bits) cannot match tokens that fit
    for j, block in enumerate(blocks):
        if block != pack(tokens[j * tpb : (j + 1) * tpb]):
            return j
    return n
