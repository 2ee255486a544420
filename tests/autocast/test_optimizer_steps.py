"""One mixprec.autocast region spanning optimizer steps: a GAN's two steps inside one region.

The semantics: casts are cached as torch caches them until an optimizer step inside the region; from
then to the region's exit every use of a weight casts afresh, bitwise as ``cache_enabled=False``.
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec

BF16 = torch.bfloat16


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))


def _gan() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = Discriminator()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    return gen, disc, opt_g, opt_d


def _train(region_of, steps: int = 3) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` GAN iterations, each one region around the D step and the G step.

    D sees real and fake in one call before its step; after it, the G loss uses D twice (its output and,
    feature matching, its features), so the second use after the step tells a cached cast from a fresh one.
    """
    gen, disc, opt_g, opt_d = _gan()
    generator = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        real = torch.randn(6, 8, generator=generator)
        z = torch.randn(6, 4, generator=generator)
        with region_of():
            fake = gen(z)
            logits = disc(torch.cat([real, fake.detach()])).float()
            target = torch.cat([torch.ones(6, 1), torch.zeros(6, 1)])
            loss_d = bce(logits, target)
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            matching = (disc.features(fake).float().mean(0) - disc.features(real).float().mean(0)).square()
            loss_g = bce(disc(fake).float(), torch.ones(6, 1)) + matching.sum()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
        losses += [loss_d.detach(), loss_g.detach()]
    state = {f"g.{k}": v for k, v in gen.state_dict().items()}
    state.update({f"d.{k}": v for k, v in disc.state_dict().items()})
    return losses, state


def test_a_region_around_two_optimizer_steps_equals_cache_disabled_bitwise() -> None:
    got = _train(lambda: mixprec.autocast("cpu", dtype=BF16))
    uncached = _train(lambda: mixprec.autocast("cpu", dtype=BF16, cache_enabled=False))
    torch_uncached = _train(lambda: torch.autocast("cpu", dtype=BF16, cache_enabled=False))
    assert torch.equal(torch.stack(uncached[0]), torch.stack(torch_uncached[0]))  # the oracle is torch's
    assert torch.equal(torch.stack(got[0]), torch.stack(torch_uncached[0]))
    for name, tensor in torch_uncached[1].items():
        assert torch.equal(got[1][name], tensor), name


def _gan_loop_phases(iterations: int):
    """A standard GAN loop cut at its optimizer steps: D is called on real and fake separately (each
    weight used twice before ``opt_d.step()``), then G's loss calls D on the fake. Returns the models and
    a list of phases, each a function that runs one forward/backward and its optimizer step."""
    gen, disc, opt_g, opt_d = _gan()
    generator = torch.Generator().manual_seed(2)
    bce = nn.functional.binary_cross_entropy_with_logits
    batches = [
        (torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator))
        for _ in range(iterations)
    ]
    fakes: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []

    def d_phase(real: torch.Tensor, z: torch.Tensor) -> None:
        fakes.append(gen(z))
        loss = bce(disc(real).float(), torch.ones(6, 1)) + bce(
            disc(fakes[-1].detach()).float(), torch.zeros(6, 1)
        )
        opt_d.zero_grad()
        loss.backward()
        opt_d.step()
        losses.append(loss.detach())

    def g_phase() -> None:
        loss = bce(disc(fakes[-1]).float(), torch.ones(6, 1))
        opt_g.zero_grad()
        loss.backward()
        opt_g.step()
        losses.append(loss.detach())

    phases = []
    for real, z in batches:
        phases += [lambda real=real, z=z: d_phase(real, z), g_phase]
    return gen, disc, phases, losses


def test_a_region_around_a_gan_loop_caches_until_the_first_step_then_casts_afresh() -> None:
    """The oracle is torch: torch.autocast (cached) up to the first optimizer step, then torch.autocast
    with cache_enabled=False; one mixprec region around the whole loop must equal it bitwise."""
    gen, disc, phases, losses = _gan_loop_phases(3)
    with mixprec.autocast("cpu", dtype=BF16):
        for phase in phases:
            phase()
    ref_gen, ref_disc, ref_phases, ref_losses = _gan_loop_phases(3)
    with torch.autocast("cpu", dtype=BF16):
        ref_phases[0]()
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        for phase in ref_phases[1:]:
            phase()
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for got, ref in ((gen, ref_gen), (disc, ref_disc)):
        for (name, a), b in zip(got.state_dict().items(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b), name


def test_torch_autocast_serves_the_stale_cast_after_the_step() -> None:
    """The behaviour mixprec departs from, kept visible: plain torch.autocast is unchanged by mixprec."""
    stale = _train(lambda: torch.autocast("cpu", dtype=BF16))
    fresh = _train(lambda: torch.autocast("cpu", dtype=BF16, cache_enabled=False))
    assert not torch.equal(torch.stack(stale[0]), torch.stack(fresh[0]))


def test_casts_stay_cached_before_the_step_and_the_flag_is_restored() -> None:
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(2, 4)

    def weight_cast(out: torch.Tensor) -> object:
        (node,) = [f for f, _ in out.grad_fn.next_functions if type(f).__name__ == "TBackward0"]
        return node.next_functions[0][0]

    with mixprec.autocast("cpu", dtype=BF16):
        first, second = lin(x), lin(x)
        assert weight_cast(first) is weight_cast(second)  # cached before any step, as torch
        (first + second).float().sum().backward()
        opt.step()
        assert not torch.is_autocast_cache_enabled()
        third, fourth = lin(x), lin(x)
        assert weight_cast(third) is not weight_cast(fourth)  # fresh at every use after the step
    assert torch.is_autocast_cache_enabled()  # torch's flag is back as it was outside
    with mixprec.autocast("cpu", dtype=BF16):
        fifth, sixth = lin(x), lin(x)
        assert weight_cast(fifth) is weight_cast(sixth)  # the next region caches again
