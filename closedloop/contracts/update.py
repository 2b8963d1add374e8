"""The update contract: how a reward maps to action tokens and a policy update.

An *objective* maps one batch, :class:`ObjectiveInputs`, to one :class:`ObjectiveOutput`:
``objective(inputs) -> output``, chosen by name or dotted path (:class:`Objective`; the
registry, which users extend, and the full contract of an objective are in
``closedloop.learn.objectives.registry``). The inputs keep the three policies apart: log πθ
(the only input with grad), log π_beh (sampled the tokens; the importance-ratio denominator)
and log π_ref (only for KL, never a denominator). ``uses_ratio`` says whether the loss weighs
πθ against π_beh through ρ = πθ/π_beh (with a clip): only such an objective may take several
optimizer steps on one fresh batch, since after the first step πθ ≠ π_beh and a ratio-free
objective would follow the wrong gradient. Under the strict synchronous contract
(π_beh = π_prox = πθ at the start of the step, one optimizer step per fresh batch) the
baseline is REINFORCE + KL:

    L = -(1/B) Σ_i A_i Σ_{t∈M_i} log πθ(a_it) + β KL(πθ || πref)

A :class:`PolicyUpdater` (``closedloop.learn.trainer.Trainer``) owns the trainable policy and
its optimizer: ``step`` scores πθ (and π_ref) on the recorded token ids of one fresh
``TrainingBatch`` (``closedloop.rollout.tensors``), applies its objective with per-episode
advantages, and takes its optimizer step(s), returning a :class:`StepResult`.

Shape letters: B episodes, T token positions. ``advantages_B`` holds one advantage per episode,
broadcast to its action tokens. ``mask_B_T`` is 1 on action tokens (aligned with the targets).
``turn_ids_B_T`` is the turn index of each action token (needed by turn reducers, turn-level
ratios and the turn clip fraction). Values of any input off the mask are ignored (NaN padding is
fine) and get zero gradient; on the mask every log-prob and advantage must be finite
(``closedloop.learn.objectives.inputs.prepare`` validates a batch).

At run time this module imports no torch: ``torch.Tensor`` appears in annotations only;
``KLSpec`` and ``TrainingBatch`` are contract records (``closedloop.contracts.batch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from closedloop.contracts.batch import KLSpec, TrainingBatch

if TYPE_CHECKING:  # annotations only (see the module docstring)
    import torch

__all__ = ["Metrics", "Objective", "ObjectiveInputs", "ObjectiveOutput", "PolicyUpdater",
           "StepResult"]

Metrics = dict[str, float | int | None]
"""Scalar metrics by namespaced key (``losses/loss``, ``ratio/ratio_max``, ``optim/lr``, ...)."""


@dataclass(frozen=True, eq=False)
class ObjectiveInputs:
    """One batch as an objective sees it; the three policies are kept apart.

    ``new_logprobs_B_T``: log πθ (being updated; the only input that carries grad).
    ``behavior_logprobs_B_T``: log π_beh (sampled the tokens; the importance-ratio denominator).
    ``ref_logprobs_B_T``: log π_ref (only for KL; never an importance denominator).
    ``reducer`` names the loss reducer (:mod:`closedloop.learn.reducers`); ``weights_B_T``
    optionally supplies its per-token weights precomputed over a larger batch (gradient
    accumulation: pass the micro-batch's rows of the full batch's weights, and the micro-batch
    losses sum to the full-batch loss). ``kl_spec`` places KL in the loss (β > 0);
    ``reward_kl_spec`` names a KL applied in the reward instead (monitoring only here).
    ``length_band_edges`` (e0, e1) split episodes by action-token count for the gradient-mass
    shares: short T_i <= e0, medium e0 < T_i <= e1, long T_i > e1.
    ``proximal_logprobs_B_T``: log π_prox when it is not π_beh (the decoupled objective: the
    trainer's weights as the step started); a ratio objective then clips πθ/π_prox and weighs
    each token by w = π_prox/π_beh, capped at ``behavior_weight_cap`` (None: uncapped).
    """

    new_logprobs_B_T: torch.Tensor
    behavior_logprobs_B_T: torch.Tensor
    advantages_B: torch.Tensor
    mask_B_T: torch.Tensor
    turn_ids_B_T: torch.Tensor | None = None
    success_B: torch.Tensor | None = None
    ref_logprobs_B_T: torch.Tensor | None = None
    entropy_B_T: torch.Tensor | None = None
    reducer: str = "episode_sum"
    kl_spec: KLSpec | None = None
    reward_kl_spec: KLSpec | None = None
    length_band_edges: tuple[int, int] = (64, 256)
    weights_B_T: torch.Tensor | None = None
    proximal_logprobs_B_T: torch.Tensor | None = None
    behavior_weight_cap: float | None = None


class ObjectiveOutput(NamedTuple):
    """Named outputs of an objective. Only ``loss`` carries grad; the rest are detached.

    ``pg_loss`` and ``kl`` are the reduced terms with ``loss = pg_loss + β·kl`` when KL is
    placed in the loss. ``kl`` is reduced with the objective's reducer; ``kl_token_mean`` is
    the plain mean over action tokens (comparable across reducers). Both are computed whenever
    ref log-probs are given, with the estimator of ``kl_spec``, else of ``reward_kl_spec``,
    else k3 (then they are monitoring only).

    Gradient mass uses the per-token coefficient c_it = ∂loss/∂log πθ(a_it), computed
    analytically (no backward); ``grad_coef_B_T`` holds it. The mass of episode i is
    m_i = Σ_t |c_it|, ``grad_mass_total`` is Σ_i m_i and the other ``grad_mass_*`` fields are
    shares of it in [0, 1] (successful vs failed episodes, length bands).

    Ratio tails are statistics of log ρ = log πθ - log π_beh over the action tokens;
    ``log_ratio_N`` holds those per-token values (detached, float64, flat in row-major order of
    the mask) so that statistics over several micro-batches can be computed exactly.

    Metrics that are undefined (no action tokens, no reference log-probs, no clipping in the
    objective, no turn ids, no success labels, no gradient mass) are ``None``, never 0.
    """

    loss: torch.Tensor
    pg_loss: float
    kl: float | None
    kl_token_mean: float | None
    entropy: float | None
    clip_frac_token: float | None
    clip_frac_turn: float | None
    clip_frac_episode: float | None
    ratio_p50: float | None
    ratio_p95: float | None
    ratio_p99: float | None
    ratio_max: float | None
    abs_log_ratio_mean: float | None
    abs_log_ratio_p99: float | None
    abs_log_ratio_max: float | None
    grad_mass_total: float
    grad_mass_success: float | None
    grad_mass_failure: float | None
    grad_mass_short: float | None
    grad_mass_medium: float | None
    grad_mass_long: float | None
    grad_coef_B_T: torch.Tensor
    log_ratio_N: torch.Tensor
    n_episodes: int
    n_action_tokens: int
    n_empty_episodes: int
    objective: str
    reducer: str
    kl_spec: KLSpec | None
    reward_kl_spec: KLSpec | None

    def metrics(self) -> dict[str, float | int | None]:
        """Scalar metrics, namespaced for logging (``losses/…``, ``clip/…``, ``ratio/…``, …)."""
        out: dict[str, float | int | None] = {"losses/loss": float(self.loss.detach())}
        for name, group in _METRIC_GROUPS.items():
            out[f"{group}/{name}"] = getattr(self, name)
        return out


_METRIC_GROUPS: dict[str, str] = {
    **dict.fromkeys(("pg_loss", "kl", "kl_token_mean", "entropy"), "losses"),
    **dict.fromkeys(("clip_frac_token", "clip_frac_turn", "clip_frac_episode"), "clip"),
    **dict.fromkeys(("ratio_p50", "ratio_p95", "ratio_p99", "ratio_max", "abs_log_ratio_mean",
                     "abs_log_ratio_p99", "abs_log_ratio_max"), "ratio"),
    **dict.fromkeys(("grad_mass_total", "grad_mass_success", "grad_mass_failure",
                     "grad_mass_short", "grad_mass_medium", "grad_mass_long"), "grad_mass"),
    **dict.fromkeys(("n_episodes", "n_action_tokens", "n_empty_episodes"), "batch"),
}


@runtime_checkable
class Objective(Protocol):
    """A named objective with its hyperparameters bound: ``objective(inputs) -> output``."""

    @property
    def name(self) -> str:
        """The name its outputs carry (``ObjectiveOutput.objective``); a registered
        objective's is the name it is registered under."""
        ...

    @property
    def uses_ratio(self) -> bool:
        """Whether the loss weighs πθ against π_beh through a (clipped) ratio."""
        ...

    def __call__(self, inputs: ObjectiveInputs) -> ObjectiveOutput:
        """Evaluate the objective on one batch."""
        ...


@dataclass(frozen=True)
class StepResult:
    """Named outputs of the optimizer steps on one fresh batch.

    ``metrics`` are those of the first pass (at the batch's behaviour policy, where the ratio
    πθ/π_beh is ≈ 1), plus ``optim/*``; ``passes`` holds every pass's metrics in order (one per
    optimizer step; after the first, the ratio has left 1). ``grad_norm`` is the first step's.
    """

    metrics: Metrics
    grad_norm: float
    n_action_tokens: int
    n_tokens: int
    passes: tuple[Metrics, ...] = ()


@runtime_checkable
class PolicyUpdater(Protocol):
    """Updates the trainable policy from recorded batches (see the module docstring).

    What a caller uses: ``step`` (the update of one fresh batch), ``objective`` (its name and
    whether it uses ratios), ``step_count`` and ``optimizer`` (the state a checkpoint saves
    and a resume restores). How the gradient is accumulated is the updater's own.
    """

    step_count: int
    """Fresh batches consumed so far (a checkpoint records and restores it)."""

    @property
    def objective(self) -> Objective:
        """The objective every step applies."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, whose ``state_dict`` a checkpoint saves and a resume loads."""
        ...

    def step(self, batch: TrainingBatch, advantages_B: torch.Tensor,
             success_B: torch.Tensor | None = None) -> StepResult:
        """The optimizer step(s) on one fresh batch; ``success_B`` labels the gradient mass."""
        ...
