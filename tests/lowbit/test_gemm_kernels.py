"""The lowbit GEMM's CPU side: the scale swizzle, the kernel decision as a table, the emulation, the Hadamard.

``to_blocked`` is checked bitwise against torchao's pure-PyTorch ``to_blocked``; ``select_kernel`` against an
expectation table (every named recipe x sm89 / sm90 / sm100 / sm120 x fprop / dgrad / wgrad), small sizes,
refused pairs and the CPU; ``emulated_mm`` against a dequantize-then-``torch.mm`` oracle written here from
each format's block layout (and torchao's MX ``to_dtype``); the emulation warning's once-per-key rule and
that a CPU run never asks CUDA anything; ``hadamard_16`` against a Sylvester construction. The CUDA calls
themselves are the fake-CUDA tier's (tests/fake_cuda/test_lowbit_kernels.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.lowbit import HP, OPERANDS, RECIPES, gemm, get_format, quantize
from mixprec.lowbit.gemm import emulated_mm, gemm_kernel_paths, gemm_operands, hadamard_16, lowbit_mm
from mixprec.lowbit.kernels import select_kernel, to_blocked

CAPS = [(8, 9), (9, 0), (10, 0), (12, 0)]
GEMMS = ("fprop", "dgrad", "wgrad")
BIG = (256, 512, 1024)  # M, K, N: multiples of every block, so nothing is padded


def _torchao(module: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module)


def _gemm_formats(recipe) -> dict[str, tuple[str, str]]:
    return {
        g: (recipe.operand(OPERANDS[2 * i]), recipe.operand(OPERANDS[2 * i + 1])) for i, g in enumerate(GEMMS)
    }


def _gemm_shapes(m: int, k: int, n: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """(A, B) of ``A @ B.T`` per GEMM (recipes.py's doc): fprop x, w; dgrad go, w.T; wgrad go.T, x.T."""
    return {"fprop": ((m, k), (n, k)), "dgrad": ((m, n), (k, n)), "wgrad": ((n, m), (k, m))}


# ---------------------------------------------------------------- to_blocked


SCALE_SHAPES = [(128, 4), (256, 8), (1, 1), (100, 3), (130, 5), (129, 33), (512, 16)]


@pytest.mark.parametrize("shape", SCALE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32])
def test_to_blocked_matches_torchao_bitwise(shape, dtype) -> None:
    utils = _torchao("torchao.prototype.mx_formats.utils")
    g = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    if dtype == torch.float32:
        scale = torch.randn(shape, generator=g)
    else:  # every byte but the NaN codes (0xFF for e8m0, 0x7F / 0xFF for e4m3), as real scales are
        scale = torch.randint(0, 127, shape, generator=g, dtype=torch.uint8).view(dtype)
    ours, ref = to_blocked(scale), utils.to_blocked(scale)
    assert ours.dtype == dtype and ours.is_contiguous() and ours.dim() == 1
    rows, cols = -(-shape[0] // 128) * 128, -(-shape[1] // 4) * 4
    assert ours.numel() == rows * cols == ref.numel()
    bits = torch.uint8 if dtype != torch.float32 else torch.int32
    assert torch.equal(ours.view(bits), ref.view(bits))


def test_to_blocked_of_real_mx_and_nvfp4_scales_matches_torchao() -> None:
    utils = _torchao("torchao.prototype.mx_formats.utils")
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(1))
    for name in ("mxfp8_floor", "nvfp4"):  # e8m0 (200, 3) and e4m3 (200, 6): both padded to 256 x 4 / 256 x 8
        scale = quantize(x, name).scale
        assert torch.equal(to_blocked(scale).view(torch.uint8), utils.to_blocked(scale).view(torch.uint8))


# ---------------------------------------------------------------- select_kernel as a table

# recipe -> capability -> (fprop, dgrad, wgrad) at BIG: a kernel name, None (emulated), "mm" (an hp operand).
_BLOCKWISE_SM90 = ("fp8_blockwise_1x128_128x128", "fp8_blockwise_1x128_128x128", "fp8_blockwise_1x128_1x128")
_NONE3 = (None, None, None)
EXPECTED: dict[str, dict[tuple[int, int], tuple[str | None, ...]]] = {
    "fp8_tensorwise": dict.fromkeys(CAPS, ("fp8_tensorwise",) * 3),  # e5m2 go x e4m3 w is a pair it takes
    "fp8_rowwise": dict.fromkeys(CAPS, ("fp8_rowwise",) * 3),
    # dgrad: rowwise go x tensorwise w, the tensorwise scale promoted to rowwise
    "fp8_rowwise_gw_hp": dict.fromkeys(CAPS, ("fp8_rowwise", "fp8_rowwise", "mm")),
    "fp8_blockwise": {**dict.fromkeys(CAPS, _NONE3), (9, 0): _BLOCKWISE_SM90},
    "mxfp8": {**dict.fromkeys(CAPS, _NONE3), (10, 0): ("mxfp8",) * 3},
    "mxfp8_floor": {**dict.fromkeys(CAPS, _NONE3), (10, 0): ("mxfp8",) * 3},
    "mxfp4": {**dict.fromkeys(CAPS, _NONE3), (10, 0): ("mxfp4",) * 3},
    "nvfp4": {**dict.fromkeys(CAPS, _NONE3), (10, 0): ("nvfp4",) * 3},
}


def test_every_named_recipe_has_expectations() -> None:
    assert set(EXPECTED) == set(RECIPES), "add the new recipe's kernel paths to EXPECTED"


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_select_kernel_table(name, cap) -> None:
    assert name in EXPECTED, f"recipe {name!r} has no row in EXPECTED"
    recipe = RECIPES[name]
    shapes = _gemm_shapes(*BIG)
    for i, (gemm_name, (fa, fb)) in enumerate(_gemm_formats(recipe).items()):
        want = EXPECTED[name][cap][i]
        if HP in (fa, fb):
            assert want == "mm", f"{name} {gemm_name}: an hp operand runs torch.mm"
            continue
        kernel, why = select_kernel(get_format(fa), get_format(fb), *shapes[gemm_name], cap)
        assert (kernel.name if kernel else None) == want, f"{name} {gemm_name} sm{cap[0]}{cap[1]}: {why}"
        assert why.startswith(f"{fa} x {fb}: ") and f"sm{cap[0]}{cap[1]}" in why
        if kernel is None:
            assert "needs sm" in why  # at BIG only the capability refuses a kernel


@pytest.mark.parametrize("name", list(RECIPES))
def test_gemm_kernel_paths_agrees_with_the_table(name) -> None:
    """The quantized (padded) operands of real layer shapes take the table's kernels, on meta tensors."""
    m, k, n = BIG
    x2, w, go = (torch.empty(s, device="meta") for s in ((m, k), (n, k), (m, n)))
    for cap in CAPS:
        paths = gemm_kernel_paths(x2, w, go, RECIPES[name], capability=cap)
        got = tuple(p if p is not None or "torch.mm" not in why else "mm" for p, why in paths.values())
        assert got == EXPECTED[name][cap], (name, cap, paths)


def test_odd_sizes_fall_back_naming_the_size() -> None:
    f = get_format
    cases = [  # formats, A, B, capability, strings the reason must hold
        ("fp8_tensorwise", "fp8_tensorwise", (32, 24), (48, 24), (9, 0), ["K=24", "multiple of 16"]),
        ("fp8_rowwise", "fp8_rowwise", (32, 32), (40, 32), (8, 9), ["N=40"]),
        ("nvfp4", "nvfp4", (32, 48), (32, 48), (10, 0), ["K=48", "multiple of 32"]),
        ("mxfp8_floor", "mxfp8_floor", (32, 64), (24, 64), (10, 0), ["N=24"]),
        ("fp8_blockwise", "fp8_blockwise_2d", (32, 64), (128, 64), (9, 0), ["K=64", "multiple of 128"]),
        (
            "fp8_blockwise",
            "fp8_blockwise_2d",
            (32, 128),
            (128, 256),
            (9, 0),
            ["padded K differ", "128 vs 256"],
        ),
    ]
    for fa, fb, sa, sb, cap, needles in cases:
        kernel, why = select_kernel(f(fa), f(fb), sa, sb, cap)
        assert kernel is None, (fa, fb, sa, sb, why)
        for needle in needles:
            assert needle in why, (needle, why)
        # the same pair at a size the kernel takes does get it: the size alone refused it
        big = 256 if "blockwise" not in fa else 512
        assert select_kernel(f(fa), f(fb), (big, big), (big, big), cap)[0] is not None


def test_a_small_layer_pads_its_blocks_and_refuses_what_padding_cannot_fix() -> None:
    """M, K, N = 20, 40, 24: mx pads K to 64 (fprop) but N = 24 is no multiple of 16; nvfp4's dgrad fits."""
    x2, w, go = (torch.empty(s, device="meta") for s in ((20, 40), (24, 40), (20, 24)))
    mx = gemm_kernel_paths(x2, w, go, RECIPES["mxfp8"], capability=(10, 0))
    assert mx["fprop"][0] is None and "N=24" in mx["fprop"][1] and "K=64" in mx["fprop"][1]
    nv = gemm_kernel_paths(x2, w, go, RECIPES["nvfp4"], capability=(10, 0))
    assert nv["fprop"][0] is None and "K=48" in nv["fprop"][1]  # 40 padded to the 16-block, not 32
    assert nv["dgrad"][0] == "nvfp4"  # go (20, 24) -> K 32; w.T (40, 24) in 16x16 blocks -> (48, 32)


def test_e5m2_pairs_are_refused_and_e5m2_with_e4m3_is_not() -> None:
    f = get_format
    for cap in CAPS:
        for a, b in (
            ("fp8_tensorwise_e5m2", "fp8_tensorwise_e5m2"),
            ("fp8_rowwise_e5m2", "fp8_rowwise_e5m2"),
        ):
            kernel, why = select_kernel(f(a), f(b), (256, 256), (256, 256), cap)
            assert kernel is None and "e5m2" in why, why
        kernel, _ = select_kernel(f("fp8_tensorwise_e5m2"), f("fp8_tensorwise"), (256, 256), (256, 256), cap)
        assert kernel is not None and kernel.name == "fp8_tensorwise"
    kernel, why = select_kernel(f("mxfp8_e5m2"), f("mxfp8_e5m2"), (256, 256), (256, 256), (10, 0))
    assert kernel is None and "e5m2" in why


def test_fnuz_is_refused_outside_rocm() -> None:
    if torch.version.hip is not None:
        pytest.skip("a ROCm build has fnuz kernels")
    f = get_format("fp8_tensorwise_fnuz")
    kernel, why = select_kernel(f, f, (256, 256), (256, 256), (9, 0))
    assert kernel is None and "ROCm" in why


def test_the_cpu_is_always_emulated() -> None:
    shapes = _gemm_shapes(*BIG)
    for recipe in RECIPES.values():
        for gemm_name, (fa, fb) in _gemm_formats(recipe).items():
            if HP not in (fa, fb):
                kernel, why = select_kernel(get_format(fa), get_format(fb), *shapes[gemm_name], None)
                assert kernel is None and "no scaled-matmul kernels on this device" in why
        x2, w, go = torch.randn(32, 64), torch.randn(48, 64), torch.randn(32, 48)
        assert all(p is None for p, _ in gemm_kernel_paths(x2, w, go, recipe).values())


# ---------------------------------------------------------------- emulated_mm vs an oracle

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _oracle_dequant(q) -> torch.Tensor:
    """The (rows, K) matrix ``q`` stands for, from its bytes and its format's block layout alone."""
    fmt = q.fmt
    if fmt.element == "e2m1":  # two codes a byte, the first in the low nibble; bit 3 the sign
        codes = torch.stack([q.data & 0xF, q.data >> 4], dim=-1).reshape(q.data.shape[0], -1).long()
        lut = torch.tensor(_E2M1 + [-v for v in _E2M1])
        values = lut[codes]
    else:
        values = q.data.to(torch.float32)
    rows, cols = (v if v != -1 else values.shape[i] for i, v in enumerate(fmt.block))
    if fmt.scale == "e8m0":
        scale = torch.exp2(q.scale.view(torch.uint8).to(torch.float32) - 127)
    elif fmt.scale == "e4m3":  # torchao NVFP4Tensor.get_hp_scales: per_tensor_scale * scale
        scale = q.scale.to(torch.float32)
        scale = scale if q.tensor_scale is None else q.tensor_scale * scale
    else:
        scale = q.scale
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    assert full.shape == values.shape
    # float32 multipliers divide (torchao float8's dequant: data / scale); descales multiply
    out = values / full if fmt.scale in ("fp32", "pow2") else values * full
    return out[: q.shape[0], : q.shape[1]]


def _recipe_gemms(name: str, m: int = 40, k: int = 72, n: int = 48):
    """(gemm, qa, qb) of a recipe's quantized GEMMs at a size every block format has to pad."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x2, w, go = (torch.randn(s, generator=g) for s in ((m, k), (n, k), (m, n)))
    ops = gemm_operands(x2, w, go, RECIPES[name])
    for gemm_name, (oa, ob) in gemm._GEMM_OPERANDS.items():
        (a, fa), (b, fb) = ops[oa], ops[ob]
        if HP not in (fa, fb):
            yield gemm_name, quantize(a, fa, pad=True), quantize(b, fb, pad=True)


@pytest.mark.parametrize("name", list(RECIPES))
def test_emulated_mm_is_dequantize_then_fp32_mm_bitwise(name) -> None:
    """Bitwise: the oracle does the same float32 operations element by element, and the same ``torch.mm``."""
    seen = 0
    for gemm_name, qa, qb in _recipe_gemms(name):
        a, b = _oracle_dequant(qa), _oracle_dequant(qb)
        want = torch.mm(a, b.t())
        got = emulated_mm(qa, qb, torch.float32)
        assert got.shape == (qa.shape[0], qb.shape[0])
        assert torch.equal(got, want), (name, gemm_name, (got - want).abs().max())
        assert torch.equal(emulated_mm(qa, qb, torch.bfloat16), want.to(torch.bfloat16))
        seen += 1
    assert seen == (2 if name == "fp8_rowwise_gw_hp" else 3)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_floor", "mxfp4"])
def test_the_mx_oracle_is_torchao_to_dtype(name) -> None:
    """The hand-written dequant equals torchao's MX ``to_dtype`` on the same bytes, bitwise."""
    mx = _torchao("torchao.prototype.mx_formats.mx_tensor")
    for _, qa, qb in _recipe_gemms(name, m=64, k=96, n=32):
        for q in (qa, qb):
            elem = torch.float4_e2m1fn_x2 if q.fmt.element == "e2m1" else torch.float8_e4m3fn
            ref = mx.to_dtype(q.data, q.scale, elem, 32, torch.float32)
            assert torch.equal(ref[: q.shape[0], : q.shape[1]], _oracle_dequant(q))


# ---------------------------------------------------------------- warn once; no CUDA query on a CPU


def test_lowbit_mm_warns_once_per_formats_device_and_reason(monkeypatch) -> None:
    monkeypatch.setattr(gemm, "_WARNED", set())
    cap = {"now": (8, 9)}
    monkeypatch.setattr(gemm, "device_capability", lambda device: cap["now"])
    g = torch.Generator().manual_seed(0)
    x, w, small = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g), torch.randn(24, 128)
    q = {f: (quantize(x, f), quantize(w, f), quantize(small, f)) for f in ("mxfp8_floor", "mxfp4")}

    def calls(fmt: str, which: int = 1) -> list[str]:
        with warnings.catch_warnings(record=True) as record:  # a fresh filter state each time, as a loop's
            warnings.simplefilter("always")
            for _ in range(3):
                out = lowbit_mm(q[fmt][0], q[fmt][which], torch.float32)
                assert torch.equal(out, emulated_mm(q[fmt][0], q[fmt][which], torch.float32))
        return [str(r.message) for r in record if "mixprec.lowbit" in str(r.message)]

    first = calls("mxfp8_floor")
    assert len(first) == 1
    assert (
        "mxfp8_floor x mxfp8_floor" in first[0]
        and "cpu (compute capability 8.9)" in first[0]
        and "needs sm10x" in first[0]
    )
    assert calls("mxfp8_floor") == []
    other_format = calls("mxfp4")
    assert len(other_format) == 1 and "mxfp4 x mxfp4" in other_format[0]
    cap["now"] = (10, 0)  # the kernel exists; the 24-row B refuses it: another reason, another warning
    other_reason = calls("mxfp8_floor", which=2)
    assert len(other_reason) == 1 and "N=24" in other_reason[0] and "10.0" in other_reason[0]
    cap["now"] = (12, 0)
    other_device = calls("mxfp8_floor")
    assert len(other_device) == 1 and "12.0" in other_device[0]
    cap["now"] = (8, 9)
    assert calls("mxfp8_floor") == [] and calls("mxfp4") == []


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_cpu_forward_and_backward_never_asks_cuda(name, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU run queried CUDA")

    for attr in ("get_device_capability", "is_available", "current_device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, attr, refuse)
    monkeypatch.setattr(gemm, "_WARNED", set())
    x = torch.randn(4, 8, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = gemm.LowbitLinearFunction.apply(x, w, RECIPES[name], torch.Generator().manual_seed(0))
        out.square().sum().backward()
    assert out.shape == (4, 8, 32) and x.grad.shape == x.shape and w.grad.shape == w.shape
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    messages = [str(r.message) for r in record if "mixprec.lowbit" in str(r.message)]
    assert messages and all("emulating the GEMM on cpu:" in m for m in messages), messages


# ---------------------------------------------------------------- Hadamard


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


def test_hadamard_16_is_orthogonal_and_sylvester_with_the_documented_signs() -> None:
    h = hadamard_16()
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    # entries are +-1/4, so every dot product of rows is exact in float32
    assert torch.equal(h @ h.t(), torch.eye(16)) and torch.equal(h.t() @ h, torch.eye(16))
    signs = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(0)) * 2 - 1  # gemm.py's doc
    assert torch.equal(h, _sylvester(16) @ torch.diag(signs.float()) / 4)


def test_hadamard_16_is_cached_per_device() -> None:
    assert hadamard_16() is hadamard_16("cpu") is hadamard_16(torch.device("cpu"))
    meta = hadamard_16("meta")
    assert meta.device.type == "meta" and meta is hadamard_16("meta") and meta is not hadamard_16()


def test_the_rotated_nvfp4_wgrad_is_the_unrotated_product() -> None:
    """The rotation cancels exactly in ``go.T @ x`` (M = 40 padded to 48 with zero rows); quantized, it is
    the product within NVFP4's error, as the unrotated quantized GEMM is."""
    g = torch.Generator().manual_seed(3)
    x2, w, go = (
        torch.randn(40, 64, generator=g),
        torch.randn(32, 64, generator=g),
        torch.randn(40, 32, generator=g),
    )
    exact = go.double().t() @ x2.double()
    recipe = RECIPES["nvfp4"]
    ops = gemm_operands(x2, w, go, recipe)
    (go_r, fa), (x_r, fb) = ops["wgrad_go"], ops["wgrad_x"]
    assert go_r.shape == (32, 48) and x_r.shape == (64, 48)
    torch.testing.assert_close(go_r.double() @ x_r.double().t(), exact, rtol=1e-5, atol=1e-5)

    def rel_err(a, b) -> float:
        out = emulated_mm(quantize(a, fa, pad=True), quantize(b, fb, pad=True), torch.float32).double()
        return float((out - exact).norm() / exact.norm())

    rotated, plain = rel_err(go_r, x_r), rel_err(go.t(), x2.t())
    assert rotated < 0.15 and plain < 0.15, (rotated, plain)  # e2m1 with 1x16 scales: ~0.1 relative
    assert rotated < 2 * plain and plain < 2 * rotated  # Gaussian data: the rotation neither helps nor hurts
