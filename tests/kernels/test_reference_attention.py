"""The torch reference backend against plain dense attention on random paged batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import dense_attention, make_batch

from kvpool_kernels import PagedAttention, window_left_for

KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@st.composite
def cases(draw: st.DrawFn) -> dict:
    batch = draw(st.integers(1, 4))
    kv_lens = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    qo_lens = [draw(st.integers(1, n)) for n in kv_lens]
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.sampled_from([-1, -1, 0, 1, 5, 17]))
    return {
        "kv_lens": kv_lens,
        "qo_lens": qo_lens,
        "page_size": draw(st.sampled_from([1, 2, 4, 16])),
        "num_kv_heads": num_kv_heads,
        "num_qo_heads": num_kv_heads * draw(st.sampled_from([1, 2, 4])),
        "head_dim": draw(st.sampled_from([4, 8, 16])),
        "kv_dtype": draw(st.sampled_from(KV_DTYPES)),
        "q_dtype": draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        "layout": draw(st.sampled_from(["NHD", "HND"])),
        "window_left": window,
        "sink_tokens": draw(st.sampled_from([0, 2])) if window >= 0 else 0,
        "q_scaling": draw(st.sampled_from([1.0, 0.5, 2.0])),
        "logits_soft_cap": draw(st.sampled_from([0.0, 0.0, 3.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


def run_reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged reference output, dense oracle output) for one case."""
    b = make_batch(
        case["kv_lens"],
        case["qo_lens"],
        page_size=case["page_size"],
        num_qo_heads=case["num_qo_heads"],
        num_kv_heads=case["num_kv_heads"],
        head_dim=case["head_dim"],
        kv_dtype=case["kv_dtype"],
        q_dtype=case["q_dtype"],
        layout=case["layout"],
        seed=case["seed"],
    )
    attn = PagedAttention(backend="auto", layout=case["layout"])
    attn.plan(
        b.qo_indptr,
        b.table.kv_indptr,
        b.table.kv_indices,
        b.table.kv_last_page_len,
        case["num_qo_heads"],
        case["num_kv_heads"],
        case["head_dim"],
        case["page_size"],
        window_left=case["window_left"],
        q_scaling=case["q_scaling"],
        logits_soft_cap=case["logits_soft_cap"],
        sink_tokens=case["sink_tokens"],
        q_dtype=case["q_dtype"],
        kv_dtype=case["kv_dtype"],
    )
    assert attn.backend_in_use == "torch"
    out = attn.run(b.q, b.cache, k_scale=b.k_scale, v_scale=b.v_scale)
    qo = b.qo_indptr.tolist()
    expected = torch.cat(
        [
            dense_attention(
                b.q[qo[i] : qo[i + 1]],
                b.keys[i],
                b.values[i],
                window_left=case["window_left"],
                q_scaling=case["q_scaling"],
                logits_soft_cap=case["logits_soft_cap"],
                sink_tokens=case["sink_tokens"],
            )
            for i in range(len(qo) - 1)
        ]
    )
    return out, expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_reference_matches_dense_attention(case: dict) -> None:
    out, expected = run_reference(case)
    assert out.dtype == case["q_dtype"]
    tol = TOL[case["q_dtype"]]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("num_qo_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"]
)
def test_decode_batch_matches_dense(num_qo_heads: int, num_kv_heads: int) -> None:
    case = {
        "kv_lens": [1, 7, 33, 64],
        "qo_lens": [1, 1, 1, 1],
        "page_size": 8,
        "num_kv_heads": num_kv_heads,
        "num_qo_heads": num_qo_heads,
        "head_dim": 16,
        "kv_dtype": torch.float32,
        "q_dtype": torch.float32,
        "layout": "NHD",
        "window_left": -1,
        "sink_tokens": 0,
        "q_scaling": 1.0,
        "logits_soft_cap": 0.0,
        "seed": 3,
    }
    out, expected = run_reference(case)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_with_cached_prefix_equals_full_prefill_rows() -> None:
    """Queries for only the uncached suffix get the same rows as a full prefill."""
    common = {
        "page_size": 4,
        "num_kv_heads": 2,
        "num_qo_heads": 4,
        "head_dim": 8,
        "kv_dtype": torch.float32,
        "q_dtype": torch.float32,
        "layout": "HND",
        "window_left": 6,
        "sink_tokens": 0,
        "q_scaling": 1.0,
        "logits_soft_cap": 0.0,
        "seed": 11,
    }
    b = make_batch([21], [21], **{k: v for k, v in common.items() if k in _BATCH_KEYS})
    attn = PagedAttention(layout="HND")
    t = b.table
    attn.plan(b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 4, 2, 8, 4,
              window_left=6, q_dtype=torch.float32, kv_dtype=torch.float32)  # fmt: skip
    full = attn.run(b.q, b.cache)
    suffix_indptr = torch.tensor([0, 5], dtype=torch.int32)
    attn.plan(suffix_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 4, 2, 8, 4,
              window_left=6, q_dtype=torch.float32, kv_dtype=torch.float32)  # fmt: skip
    suffix = attn.run(b.q[16:], b.cache)
    torch.testing.assert_close(suffix, full[16:], atol=1e-6, rtol=1e-6)


_BATCH_KEYS = {"page_size", "num_kv_heads", "num_qo_heads", "head_dim", "kv_dtype", "q_dtype",
               "layout", "seed"}  # fmt: skip


def test_sink_logits_lower_every_weight() -> None:
    """A per-head sink logit adds exp(sink) to the softmax denominator and nothing to the sum."""
    b = make_batch([9], [3], page_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                   kv_dtype=torch.float32)  # fmt: skip
    t = b.table
    args = (b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 2, 1, 8, 4)
    attn = PagedAttention()
    attn.plan(*args, q_dtype=torch.float32)
    plain = attn.run(b.q, b.cache)
    attn.plan(*args, q_dtype=torch.float32, sinks=torch.tensor([-1e9, 0.5]))
    sunk = attn.run(b.q, b.cache)
    torch.testing.assert_close(sunk[:, 0], plain[:, 0])
    # Head 1: out = sum(w_j v_j) / (Z + e^0.5) where plain = sum(w_j v_j) / Z.
    keys = b.keys[0][:, 0]
    logits = b.q[:, 1].double() @ keys.T / 8**0.5
    causal = torch.arange(9)[None, :] <= torch.arange(6, 9)[:, None]
    z = (torch.exp(logits) * causal).sum(-1, keepdim=True)
    ratio = (z / (z + torch.exp(torch.tensor(0.5, dtype=torch.float64)))).float()
    torch.testing.assert_close(sunk[:, 1], plain[:, 1] * ratio, atol=1e-6, rtol=1e-5)


def test_window_left_for_matches_trtllm_window() -> None:
    assert window_left_for(1) == 0
    assert window_left_for(4096) == 4095
    assert window_left_for(1 << 62) == -1
    with pytest.raises(ValueError, match="attention_window"):
        window_left_for(0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_qo_heads": 6, "num_kv_heads": 4}, "num_qo_heads"),
        ({"window_left": -2}, "window_left"),
        ({"q_scaling": 0.0}, "q_scaling"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
        ({"page_size": 8}, "kv_last_page_len"),
    ],
)
def test_plan_rejects_bad_settings(kwargs: dict, match: str) -> None:
    b = make_batch([9], [3], page_size=16, num_qo_heads=4, num_kv_heads=4, head_dim=8,
                   kv_dtype=torch.float32)  # fmt: skip
    t = b.table
    args = {"num_qo_heads": 4, "num_kv_heads": 4, "head_dim": 8, "page_size": 16} | kwargs
    last = t.kv_last_page_len + (7 if "page_size" in kwargs else 0)
    with pytest.raises(ValueError, match=match):
        PagedAttention().plan(b.qo_indptr, t.kv_indptr, t.kv_indices, last, **args)


def test_plan_rejects_more_queries_than_keys() -> None:
    b = make_batch([3], [3], page_size=4, num_qo_heads=1, num_kv_heads=1, head_dim=4,
                   kv_dtype=torch.float32)  # fmt: skip
    t = b.table
    with pytest.raises(ValueError, match="more query tokens"):
        PagedAttention().plan(torch.tensor([0, 4], dtype=torch.int32), t.kv_indptr,
                              t.kv_indices, t.kv_last_page_len, 1, 1, 4, 4)  # fmt: skip


def test_run_checks_dtypes_and_shapes() -> None:
    b = make_batch([5], [2], page_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                   kv_dtype=torch.float16, q_dtype=torch.float16)  # fmt: skip
    t = b.table
    attn = PagedAttention()
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(b.q, b.cache)
    attn.plan(b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="q: dtype"):
        attn.run(b.q.float(), b.cache)
    with pytest.raises(ValueError, match="kv_cache: dtype"):
        attn.run(b.q, b.cache.float())
    with pytest.raises(ValueError, match="q: expected shape"):
        attn.run(b.q[:1], b.cache)


def test_explicit_flashinfer_backend_refuses_cpu() -> None:
    b = make_batch([5], [1], page_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=64,
                   kv_dtype=torch.float16, q_dtype=torch.float16)  # fmt: skip
    t = b.table
    with pytest.raises(NotImplementedError, match="CUDA"):
        PagedAttention(backend="flashinfer").plan(
            b.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, 2, 1, 64, 4
        )
