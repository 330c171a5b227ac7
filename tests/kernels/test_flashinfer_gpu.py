"""flashinfer against the torch reference, and copies on a real device (GPU machines only)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernel_cases import PagedBatch, make_batch

from kvpool_kernels import (
    PagedAttention,
    PagedKvTable,
    append_kv,
    append_slots,
    copy_blocks,
    new_pool,
    reference_attention,
)
from kvpool_kernels.attention import Backend
from kvpool_kernels.copy import device_alias
from kvpool_kernels.flashinfer_backend import flashinfer_available

needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA + flashinfer")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# flashinfer's own test tolerances (tests/attention/*): fp16 1e-3, bf16 1e-2, fp8 KV 1e-2/2e-1.
FI_TOL = {
    (torch.float16, torch.float16): (1e-3, 1e-3),
    (torch.bfloat16, torch.bfloat16): (1e-2, 1e-2),
    (torch.float16, torch.float8_e4m3fn): (1e-2, 2e-1),
    (torch.bfloat16, torch.float8_e4m3fn): (2e-2, 2e-1),
}


def test_importing_the_kernels_does_not_import_flashinfer() -> None:
    """CPU paths never load flashinfer (it is an optional extra and slow to import)."""
    code = (
        "import sys, torch, kvpool_kernels as k\n"
        "t = k.PagedKvTable.from_block_lists([[0]], [3], 4)\n"
        "a = k.PagedAttention()\n"
        "a.plan(torch.tensor([0, 1], dtype=torch.int32), t.kv_indptr, t.kv_indices,\n"
        "       t.kv_last_page_len, 2, 1, 64, 4)\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n"
    )
    if torch.cuda.is_available():
        pytest.skip("on CUDA machines auto may legitimately load flashinfer")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_flashinfer_implementation_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvpool_kernels.flashinfer_backend import BACKEND_ENV, flashinfer_backend_choice

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert flashinfer_backend_choice() == "fa2"  # the implementation the GPU tests checked
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert flashinfer_backend_choice() == "auto"
    monkeypatch.setenv(BACKEND_ENV, "fa4")
    with pytest.raises(ValueError, match="KVPOOL_FLASHINFER_BACKEND='fa4': allowed values are"):
        flashinfer_backend_choice()


def _plan_and_run(backend: Backend, b: PagedBatch, case: dict) -> torch.Tensor:
    attn = PagedAttention(backend=backend, layout=case["layout"])
    t = b.table
    attn.plan(
        b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len,
        case["num_qo_heads"], case["num_kv_heads"], case["head_dim"], case["page_size"],
        window_left=case["window_left"], logits_soft_cap=case["logits_soft_cap"],
        q_scaling=case["q_scaling"], q_dtype=case["q_dtype"], kv_dtype=case["kv_dtype"],
    )  # fmt: skip
    assert attn.backend_in_use == backend
    return attn.run(b.q, b.cache, k_scale=b.k_scale, v_scale=b.v_scale)


def _cases() -> list:
    """A covering set rather than the full product: every JIT variant costs a compile."""
    f16, b16, fp8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
    modes = ("decode", "prefill", "prefill-with-prefix")
    out = []
    for q_dtype, kv_dtype in FI_TOL:
        for mode in modes:
            out.append(("NHD", q_dtype, kv_dtype, 32, 8, mode, -1, 0.0))
    for heads in ((8, 8), (16, 1)):
        for mode in ("decode", "prefill-with-prefix"):
            out.append(("NHD", f16, f16, *heads, mode, -1, 0.0))
    for q_dtype, kv_dtype in ((f16, f16), (b16, fp8)):
        for mode in ("decode", "prefill-with-prefix"):
            out.append(("NHD", q_dtype, kv_dtype, 32, 8, mode, 37, 0.0))
    for mode in ("decode", "prefill"):
        out.append(("NHD", f16, f16, 32, 8, mode, -1, 30.0))
        out.append(("HND", f16, f16, 32, 8, mode, -1, 0.0))
        out.append(("HND", b16, fp8, 32, 8, mode, 37, 0.0))
    return out


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize(
    (
        "layout", "q_dtype", "kv_dtype", "num_qo_heads", "num_kv_heads", "mode",
        "window_left", "soft_cap",
    ),
    _cases(),
)  # fmt: skip
def test_flashinfer_matches_reference(
    layout: str,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_qo_heads: int,
    num_kv_heads: int,
    mode: str,
    window_left: int,
    soft_cap: float,
) -> None:
    kv_lens = [1, 17, 130, 301]
    qo_lens = {
        "decode": [1, 1, 1, 1],
        "prefill": kv_lens,
        "prefill-with-prefix": [1, 5, 64, 100],
    }[mode]
    case = {
        "page_size": 16, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
        "head_dim": 128, "kv_dtype": kv_dtype, "q_dtype": q_dtype, "layout": layout,
        "window_left": window_left, "logits_soft_cap": soft_cap, "q_scaling": 1.0,
    }  # fmt: skip
    b = make_batch(
        kv_lens, qo_lens, seed=7, device="cuda",
        **{k: case[k] for k in ("page_size", "num_qo_heads", "num_kv_heads", "head_dim",
                                "kv_dtype", "q_dtype", "layout")},
    )  # fmt: skip
    got = _plan_and_run("flashinfer", b, case)
    expected = _plan_and_run("torch", b, case)
    atol, rtol = FI_TOL[(q_dtype, kv_dtype)]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_append_matches_flashinfer_append_exactly(layout: str, dtype: torch.dtype) -> None:
    import flashinfer

    page, heads, dim = 16, 8, 128
    table = PagedKvTable.from_block_lists([[3, 9], [0, 4, 5]], [20, 40], page, device="cuda")
    lens = [7, 12]
    k = torch.randn(19, heads, dim, device="cuda").to(dtype)
    v = torch.randn(19, heads, dim, device="cuda").to(dtype)
    ours = new_pool(1, 10, page, heads, dim, dtype=dtype, layout=layout, device="cuda")[0]
    theirs = ours.clone()
    append_kv(ours, k, v, append_slots(table, lens), layout=layout)
    append_indptr = torch.tensor([0, 7, 19], dtype=torch.int32, device="cuda")
    seq_lens = flashinfer.get_seq_lens(table.kv_indptr, table.kv_last_page_len, page)
    batch_idx, pos = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, 19)
    flashinfer.append_paged_kv_cache(
        k, v, batch_idx, pos, theirs, table.kv_indices, table.kv_indptr,
        table.kv_last_page_len, kv_layout=layout,
    )  # fmt: skip
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("via", ["direct", "staged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_offload_onboard_and_device_copies_are_bit_exact(dtype: torch.dtype, via: str) -> None:
    dev = torch.randn(4, 64, 2, 16, 8, 128, device="cuda").to(dtype)
    host = new_pool(4, 32, 16, 8, 128, dtype=dtype, pin_memory=True)
    host.view(torch.uint8).fill_(0x55)
    before = host.clone()
    ids = [5, 63, 0, 17, 40]
    copy_blocks(dev, host, ids, [1, 2, 3, 30, 31], via=via)  # type: ignore[arg-type]
    offloaded = host[:, [1, 2, 3, 30, 31]].view(torch.uint8)
    assert torch.equal(offloaded, dev[:, ids].cpu().view(torch.uint8))
    others = [i for i in range(32) if i not in (1, 2, 3, 30, 31)]
    assert torch.equal(host[:, others].view(torch.uint8), before[:, others].view(torch.uint8))
    back = torch.zeros_like(dev)
    copy_blocks(host, back, [1, 2, 3, 30, 31], ids, via=via)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    assert torch.equal(back[:, ids].view(torch.uint8), dev[:, ids].view(torch.uint8))
    before = dev.clone()
    copy_blocks(dev, dev, [0, 1], [1, 2])  # within the device pool, overlapping
    assert torch.equal(dev[:, 1:3].view(torch.uint8), before[:, 0:2].view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
def test_reference_runs_on_cuda() -> None:
    b = make_batch([9, 33], [9, 1], page_size=8, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                   kv_dtype=torch.float16, q_dtype=torch.float16, device="cuda")  # fmt: skip
    attn = PagedAttention(backend="torch")
    plan = attn.plan(b.qo_indptr, b.table.kv_indptr, b.table.kv_indices,
                     b.table.kv_last_page_len, 4, 2, 16, 8)  # fmt: skip
    out = attn.run(b.q, b.cache)
    cpu = reference_attention(b.q.cpu(), b.cache.cpu(), plan)
    torch.testing.assert_close(out.cpu(), cpu, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_a_plan_for_device_cuda_runs_on_tensors_of_the_current_device(backend: Backend) -> None:
    """``device="cuda"`` (no index, as users write it) plans for the current device, whose
    tensors say ``cuda:0``: run accepts them."""
    b = make_batch([40, 7], [1, 1], page_size=16, num_qo_heads=32, num_kv_heads=8,
                   head_dim=128, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    attn = PagedAttention(backend=backend)
    t = b.table
    attn.plan(b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 32, 8, 128,
              16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out = attn.run(b.q, b.cache)
    assert out.device == b.q.device and out.shape == b.q.shape


@pytest.mark.gpu
@needs_cuda
def test_a_pinned_pool_view_is_aliased_in_place_on_the_device() -> None:
    """``device_alias`` gives a CUDA tensor over the very bytes of a pinned (strided) view:
    a GPU write lands in host memory; pageable memory gets no alias."""
    arena = torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=True)
    view = arena[4096:].view(torch.bfloat16).view(2, -1)[:, 8:24]
    alias = device_alias(view, torch.device("cuda"))
    assert alias is not None and alias.device.type == "cuda" and alias.shape == view.shape
    alias.fill_(1.5)
    torch.cuda.synchronize()
    assert bool((view == 1.5).all()) and int((arena != 0).sum()) == 2 * 16 * 2
    assert device_alias(torch.zeros(16), torch.device("cuda")) is None
    with pytest.raises(ValueError, match="not pinned"):
        copy_blocks(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, device="cuda"), [0], [1],
                    via="direct")  # fmt: skip
