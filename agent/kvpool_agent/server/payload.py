"""The binary tensor frame used for KV block payloads, attention queries and outputs.

A frame is a fixed header, the shape, then the raw little-endian tensor bytes:

    offset  size  field
    0       4     magic  b"KVPT"
    4       2     version (1)
    6       1     dtype code (see ``DTYPE_CODES``)
    7       1     ndim
    8       4     CRC-32 of the data bytes (zlib.crc32)
    12      8     data length in bytes
    20      8*n   shape, one uint64 per dimension
    ...           data: the tensor, C-contiguous

The receiver checks every field (magic, version, dtype, shape against data length, CRC)
before it touches the cache, so a truncated or corrupted upload is rejected and changes
nothing. Version bumps are for incompatible layout changes; a reader rejects versions it
does not know.
"""

from __future__ import annotations

import struct
import zlib

import torch

MAGIC = b"KVPT"
VERSION = 1
_HEADER = struct.Struct("<4sHBBIQ")
MAX_NDIM = 8

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.int8: 5,
    torch.uint8: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

MEDIA_TYPE = "application/vnd.kvpool.tensor"
"""Content type of a frame on the HTTP API."""


class PayloadError(ValueError):
    """A frame that cannot be decoded: the message says which field is wrong."""


def encode_tensor(tensor: torch.Tensor) -> bytes:
    """Frame a tensor (any device; copied to CPU) with its dtype, shape and checksum."""
    if tensor.dtype not in DTYPE_CODES:
        raise PayloadError(f"dtype: {tensor.dtype} cannot be framed")
    if tensor.dim() > MAX_NDIM:
        raise PayloadError(f"ndim: at most {MAX_NDIM} dimensions, got {tensor.dim()}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    header = _HEADER.pack(
        MAGIC, VERSION, DTYPE_CODES[tensor.dtype], tensor.dim(), zlib.crc32(data), len(data)
    )
    shape = struct.pack(f"<{tensor.dim()}Q", *tensor.shape)
    return header + shape + data


def decode_tensor(frame: bytes) -> torch.Tensor:
    """The tensor in a frame (CPU); raises PayloadError naming the first bad field."""
    if len(frame) < _HEADER.size:
        raise PayloadError(f"frame: {len(frame)} bytes is shorter than the header")
    magic, version, code, ndim, crc, nbytes = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise PayloadError(f"magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise PayloadError(f"version: this agent reads version {VERSION}, got {version}")
    dtype = _CODE_DTYPES.get(code)
    if dtype is None:
        raise PayloadError(f"dtype: unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"ndim: at most {MAX_NDIM} dimensions, got {ndim}")
    offset = _HEADER.size + 8 * ndim
    if len(frame) < offset:
        raise PayloadError("shape: frame ends inside the shape")
    shape = struct.unpack_from(f"<{ndim}Q", frame, _HEADER.size)
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * elem != nbytes:
        raise PayloadError(f"length: shape {list(shape)} needs {numel * elem} bytes, got {nbytes}")
    if len(frame) - offset != nbytes:
        raise PayloadError(
            f"length: header says {nbytes} data bytes, frame has {len(frame) - offset}"
        )
    data = frame[offset:]
    if zlib.crc32(data) != crc:
        raise PayloadError("checksum: CRC-32 of the data does not match the header")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
