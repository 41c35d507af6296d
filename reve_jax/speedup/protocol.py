"""A benchmark size's protocol (configs/speedup/<size>.py) and the config of each of its runs."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from pathlib import Path

import jax

from reve_jax import config as config_lib
from reve_jax import xla

PRIMARY = "align_overall"
# The headline's 2x2, {latent DiT, pixel recipe} x {AdamW, Muon}, read as four factors (name, slower cell, faster
# cell): each is the ratio of two cells' times to baseline A's plateau, reported where both cells ran
FACTORS = (
    ("the pixel recipe, with AdamW", "latent", "recipe"),
    ("the pixel recipe, with Muon", "latent+muon", "recipe+muon"),
    ("Muon, on the latent DiT", "latent", "latent+muon"),
    ("Muon, on the pixel recipe", "recipe", "recipe+muon"),
)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A benchmark size's protocol (see the module docstring); the run configs come from the same file.

    steps: the budget of every run; evals: evaluations over it (every steps/evals steps); n_eval / n_final: captions of
    the `split` compositions (unseen: never in the training stream) per evaluation / at the end; seeds: the headline's
    (fresh: never a tuning seed); tune_seeds and tune_eval_seed: the sweeps' seeds and evaluation noise, so nothing
    chosen on a seed is reported on it; baseline: the method the others are timed against; methods: the headline
    comparison (the 2x2 of {latent DiT, JIT-DDT recipe} x {AdamW, Muon}); further: the other methods of the size
    (baseline B, the PRX variant, ablations), run by their own command; sweep_lrs: the LR grid every method's sweep
    starts from (each rate of a Muon arm too); sweep_around: k > 0 starts each method's sweep instead from the 2k + 1
    rates in factors of 2 centred on its frozen rate (a size whose rates come from a smaller size's sweeps: every method
    gets the same span around its own prior, a cheaper sweep of equal effort); sweep_from: per Muon arm, the rate of the
    group not being swept that each of its sweeps holds ({"muon_lr": v}: Muon's rate during the AdamW group's sweep, the
    value frozen when that sweep began), so freezing the winners later changes none of the sweep's runs, and Muon's grid
    reaches v (sweeps.py); cfg_scales: the guidance scales every method tries; gate_final / gate_gain: the per-seed
    validity gate (analysis.py); min_recon_align: the autoencoder's reconstruction check."""

    name: str
    steps: int
    seeds: tuple[int, ...] = (10, 11, 12, 13, 14)  # fresh: seeds 0-2 chose rates under the earlier protocol
    tune_seeds: tuple[int, ...] = (100, 101)
    tune_eval_seed: int = 5321
    split: str = "unseen"
    evals: int = 20
    n_eval: int = 256
    n_final: int = 512
    baseline: str = "latent"
    methods: tuple[str, ...] = ("latent+muon", "recipe", "recipe+muon")
    further: tuple[str, ...] = ()
    sweep_lrs: tuple[float, ...] = (5e-4, 1e-3, 2e-3, 4e-3)
    sweep_around: int = 0
    sweep_from: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    cfg_scales: tuple[float, ...] = (1.5, 3.0, 5.0)
    gate_final: float = 0.45
    gate_gain: float = 0.2
    min_recon_align: float = 0.98
    eval_seed: int = 4321
    config: str = ""

    @property
    def eval_every(self) -> int:
        return max(1, self.steps // self.evals)

    def sweep_grid(self, frozen_rate: float) -> list[float]:
        """The rates a method's sweep starts from: `sweep_lrs`, or with `sweep_around` the span around its frozen
        rate."""
        if self.sweep_around > 0:
            return [frozen_rate * 2.0**k for k in range(-self.sweep_around, self.sweep_around + 1)]
        return sorted(self.sweep_lrs)

    def check_seeds(self, seeds) -> None:
        """A headline on a tuning seed would report what was chosen on it: refuse."""
        both = sorted(set(seeds) & set(self.tune_seeds))
        if both:
            raise ValueError(
                f"seeds {both} are tuning seeds of size {self.name} (tune_seeds {list(self.tune_seeds)}): the "
                "headline runs on fresh seeds, so that nothing chosen on a seed is reported on it"
            )


def load_protocol(path: str | Path) -> Protocol:
    """The PROTOCOL of a speedup config file (configs/speedup/<size>.py), with its path recorded."""
    module = config_lib.load_module(str(path))
    if not isinstance(getattr(module, "PROTOCOL", None), Protocol):
        raise config_lib.ConfigError(f"{path} defines no PROTOCOL = speedup.Protocol(...): not a speedup size file")
    return dataclasses.replace(module.PROTOCOL, config=str(path))


def machine() -> dict:
    """Where the benchmark ran: host, CPU model and count, JAX devices and the load average (other users' work
    counts)."""
    return {
        "host": platform.node(),
        "cpu": xla.cpu_model(),
        "cpus": os.cpu_count(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "loadavg": list(os.getloadavg()),
    }


RATES = ("lr", "muon_lr")  # the optimizer rates a sweep can vary: the main (AdamW) group's, Muon's group's


def build_config(size: Protocol, method: str, seed: int, extra: tuple[str, ...] = (), lr: float | None = None,
                 rate: str = "lr"):  # fmt: skip
    """The config of one run: the size file's config for `method` (its model, data, frozen LR and guidance), then
    the protocol's budget and checkpoint cadence (a checkpoint at every evaluation), the seed (model and data),
    `lr` when given (the sweep) as the optimizer's `rate` (one of RATES; the other keeps its frozen value, or the
    value the size's `sweep_from` says the sweep of `rate` holds it at), and `extra` overrides."""
    if rate not in RATES:
        raise ValueError(f"unknown rate {rate!r}: a sweep varies one of {RATES}")
    items = [f"train.steps={size.steps}", f"train.ckpt_every={size.eval_every}", f"seed={seed}", f"data.seed={seed}"]
    if lr is not None:
        held = {k: v for k, v in size.sweep_from.get(method, {}).items() if k != rate}
        items += [f"optim.{k}={v!r}" for k, v in held.items()] + [f"optim.{rate}={lr!r}"]
    cfg = config_lib.load_config(f"{size.config}:{method}", [*items, *extra])
    if lr is not None and rate == "muon_lr" and cfg.optim.name != "muon":
        raise ValueError(f"{method} trains with {cfg.optim.name}, not Muon: sweep its rate with --rate lr")
    return cfg


def _read_keys(cfg_json: str) -> dict:
    """A config's JSON as a dict without the keys the run never read: Muon's settings (optim.muon_*) when the
    optimizer is not Muon, the sampler's clamp (sample.t_eps) when the model does not predict x; the autoencoder's
    path as its file name (latent/training.py `cache_path`: named by the hash of what it was trained on); nor the
    checkpoint cadence (train.ckpt_every: a resumed run ends where an uninterrupted one does, so it changes no
    result)."""
    d = json.loads(cfg_json)
    d["train"].pop("ckpt_every", None)
    if d["optim"]["name"] != "muon":
        d["optim"] = {k: v for k, v in d["optim"].items() if not k.startswith("muon_")}
    if d["diffusion"]["prediction"] != "x":
        d["sample"] = {k: v for k, v in d["sample"].items() if k != "t_eps"}
    if d["latent"].get("path"):  # the autoencoder's file name holds its settings' hash; its directory is a machine's
        d["latent"]["path"] = os.path.basename(d["latent"]["path"])
    return d


def same_config(saved: str | None, cfg, *, any_guidance: bool = False) -> bool:
    """Whether a finished run's saved config (JSON) is `cfg`'s; keys added to the config since it ran are read at
    the value it ran under (config.ADDED_KEYS), so a new option does not invalidate finished runs, and keys the run
    never read do not count (`_read_keys`: an AdamW run does not depend on Muon's rate). `any_guidance`: the
    sampler's guidance scale does not count either (a sweep run's record, scored at every scale of the size: its
    training never reads the scale, so freezing another one keeps it)."""
    if saved is None:
        return False
    a, b = _read_keys(config_lib.to_json(config_lib.from_json(saved))), _read_keys(config_lib.to_json(cfg))
    if any_guidance:
        a["sample"].pop("cfg_scale"), b["sample"].pop("cfg_scale")
    return a == b
