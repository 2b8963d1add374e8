"""A recurrent actor–critic over an environment's observation features, run through the
collector like any other policy (the recurrent actor–critic, docs/credit.md).

The environment package's ``FeatureCodec`` turns each observation into a 0/1 feature vector
and each macro-action index into an ``Action``. The policy never sees text:

- :class:`FeatureRenderer` is the collector's renderer: an observation's "tokens" are its
  features, feature i with bit b written as id 2i + b (:func:`encode_features`;
  :func:`decode_features` inverts it), so a trace's ``prompt_token_ids`` hold exactly what the
  policy read, and an action's single id is its macro-action index;
- :class:`RecurrentActorCritic` is a GRU cell over [features of o_k, one-hot of a_{k-1}] with a
  policy head (logits over the codec's actions, masked to the ones the observation offers) and
  a value head V(h_k) on the same hidden state: the value function over histories at turn
  boundaries;
- :class:`FeatureSource` is the collector's ``ActionSource``: one batched GRU step per turn for
  all live episodes, each sampled from its own stream (the collector's per-episode stream),
  recording the log-probability of the masked distribution that drew the action (0 under
  greedy decoding, a point mass).

Shape letters: B episodes, K turns, F features, A actions, H hidden units.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from closedloop.contracts import SamplerConfig, content_hash, parse_action, sha256_hex
from closedloop.contracts.package import EnvPackage, FeatureCodec
from closedloop.errors import ActionParseError, LearnError
from closedloop.rollout.source import ActionSample

__all__ = ["FeatureRenderer", "FeatureSource", "RecurrentActorCritic", "action_mask",
           "decode_features", "encode_features"]


def action_mask(codec: FeatureCodec, features: Sequence[int]) -> tuple[bool, ...]:
    """The codec's mask for ``features``, all True when it does not say."""
    mask = codec.action_mask(features)
    if mask is None:
        return (True,) * len(codec.actions)
    if len(mask) != len(codec.actions) or not any(mask):
        raise LearnError(f"codec {codec.version}: a mask needs one entry per action and one True")
    return tuple(mask)


def encode_features(bits: Sequence[int]) -> list[int]:
    """Feature i with bit b as token id 2i + b."""
    if any(b not in (0, 1) for b in bits):
        raise LearnError(f"features must be 0/1, got {list(bits)}")
    return [2 * i + int(b) for i, b in enumerate(bits)]


def decode_features(ids: Sequence[int], n_features: int) -> list[int]:
    """Invert :func:`encode_features` (``LearnError`` unless the ids are exactly such a
    vector of ``n_features`` entries)."""
    if len(ids) != n_features or any(t // 2 != i for i, t in enumerate(ids)):
        raise LearnError(f"ids {list(ids)[:16]} are not an encoded {n_features}-feature vector")
    return [t % 2 for t in ids]


class FeatureRenderer:
    """The collector's renderer for a feature policy (see the module docstring); its hashes
    name the codec and the package's scaffold for the ``PolicyManifest``."""

    def __init__(self, package: EnvPackage) -> None:
        if package.feature_codec is None:
            raise LearnError(f"environment package {package.env_id!r} has no feature codec")
        self.package = package
        self.codec: FeatureCodec = package.feature_codec

    def render_prompt(self, task_text: str) -> list[int]:
        """The features of the opening observation."""
        return encode_features(self.codec.features(task_text))

    def render_observation(self, observation_text: str, *, turn_closed: bool = False
                           ) -> list[int]:
        """The features of an observation (nothing closes a turn here)."""
        return encode_features(self.codec.features(observation_text))

    def turn_closed(self, action_ids: Sequence[int]) -> bool:
        """Always True: an action is one id."""
        return True

    def encode(self, action_text: str) -> list[int]:
        """The one id of an action text (its index in the codec's actions), so scripted
        policies play in this scaffold too; ``LearnError`` for text naming no codec action."""
        try:
            action = parse_action(action_text)
        except ActionParseError as exc:
            raise LearnError(f"not a codec action: {exc.reason}") from None
        if action.name not in self.codec.actions or action.args:
            raise LearnError(f"{action.name!r} is not one of {list(self.codec.actions)}")
        return [self.codec.actions.index(action.name)]

    def action_text(self, action_ids: Sequence[int]) -> str:
        """The model text of the action an id names."""
        return self.codec.action(int(action_ids[0])).model_text()

    def system_prompt_hash(self) -> str:
        """sha256 of the package's system prompt (the policy never reads it, but it is the
        package's scaffold)."""
        return sha256_hex(self.package.system_prompt)

    def template_hash(self) -> str:
        """The codec stands in for the chat template: its version, actions and width."""
        return content_hash({"codec": self.codec.version, "actions": list(self.codec.actions),
                             "n_features": self.codec.n_features})

    def tool_schema_hash(self) -> str:
        """The content hash of the package's tool schemas."""
        return content_hash([dict(s) for s in self.package.tool_schemas])


_MASKED = -1e9
"""The logit of an action the observation does not offer: its probability underflows to exactly
0 while every log-prob stays finite (an entropy or a gradient never meets 0·∞)."""


class RecurrentActorCritic(nn.Module):
    """GRU cell over [features, previous action one-hot] with policy and value heads."""

    def __init__(self, n_features: int, n_actions: int, hidden: int = 64, seed: int = 0
                 ) -> None:
        super().__init__()
        self.n_features, self.n_actions, self.hidden = n_features, n_actions, hidden
        gen = torch.Generator().manual_seed(seed)
        self.cell = nn.GRUCell(n_features + n_actions, hidden)
        self.policy = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=gen)
                        / math.sqrt(max(p.shape[-1], 1)))
            self.policy.weight.mul_(0.01)
            self.policy.bias.zero_()

    def initial(self, batch: int) -> torch.Tensor:
        """h before the first observation: zeros [B, H]."""
        return torch.zeros(batch, self.hidden)

    def step(self, features_B_F: torch.Tensor, prev_action_B: torch.Tensor,
             h_B_H: torch.Tensor, mask_B_A: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One turn: (masked log-probs [B, A], V(h) [B], new h [B, H]).

        ``prev_action_B`` is -1 before the first action; ``mask_B_A`` is True where allowed.
        """
        prev = torch.zeros(features_B_F.shape[0], self.n_actions)
        has = prev_action_B >= 0
        prev[has, prev_action_B[has]] = 1.0
        h = self.cell(torch.cat([features_B_F, prev], dim=1), h_B_H)
        logits = self.policy(h).masked_fill(~mask_B_A, _MASKED)
        return torch.log_softmax(logits, dim=-1), self.value(h).squeeze(-1), h

    def unroll(self, features_B_K_F: torch.Tensor, actions_B_K: torch.Tensor,
               masks_B_K_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over K boundaries: (log-probs [B, K, A], values [B, K]). Boundary k
        reads o_k and a_{k-1} (the recorded actions; -1 where none)."""
        b, k, _ = features_B_K_F.shape
        h = self.initial(b)
        logps, values = [], []
        prev = torch.full((b,), -1, dtype=torch.long)
        for j in range(k):
            logp, v, h = self.step(features_B_K_F[:, j], prev, h, masks_B_K_A[:, j])
            logps.append(logp)
            values.append(v)
            prev = actions_B_K[:, j]
        return torch.stack(logps, dim=1), torch.stack(values, dim=1)


@dataclass
class _Session:
    h: torch.Tensor
    features: list[int]
    mask: tuple[bool, ...]
    prev: int = -1
    rng: random.Random = field(default_factory=random.Random)


class FeatureSource:
    """The collector's ``ActionSource`` for a :class:`RecurrentActorCritic` (module docstring).

    ``sampler.greedy`` takes the arg-max (log-prob 0, a point mass); otherwise actions are drawn
    at ``sampler.temperature`` from the masked distribution, whose log-probability is recorded
    as both the behaviour and the raw log-prob. Each episode's stream seeds its own RNG.
    """

    def __init__(self, model: RecurrentActorCritic, codec: FeatureCodec,
                 sampler: SamplerConfig, build: str = "recurrent-ac") -> None:
        if sampler.top_p < 1.0 or sampler.top_k is not None or sampler.temperature != 1.0:
            raise LearnError("the feature policy samples its full masked distribution at "
                             "temperature 1.0 (or greedily): top_p, top_k and other "
                             "temperatures are not implemented")
        self.model, self.codec, self.sampler, self.build = model, codec, sampler, build
        self._sessions: dict[str, _Session] = {}

    def _observe(self, session: _Session, ids: Sequence[int]) -> None:
        session.features = decode_features(ids, self.codec.n_features)
        session.mask = action_mask(self.codec, session.features)

    def open(self, key: str, task_id: str, prompt_ids: list[int], observation: str,
             stream: int | None = None) -> None:
        """Start an episode from its context ids: the opening features, or a whole recorded
        prefix o_0, a_0, …, o_t (a branch), whose actions the GRU re-reads to rebuild its
        memory exactly as the parent had it before acting at t."""
        f = self.codec.n_features
        if (len(prompt_ids) - f) % (f + 1):
            raise LearnError(f"context of {len(prompt_ids)} ids is not o_0, a_0, …, o_t")
        session = _Session(self.model.initial(1)[0], [], (), -1, random.Random(stream))
        for start in range(0, len(prompt_ids) - f, f + 1):
            self._observe(session, prompt_ids[start:start + f])
            action = int(prompt_ids[start + f])
            with torch.no_grad():
                _, _, h = self.model.step(
                    torch.tensor([session.features], dtype=torch.float32),
                    torch.tensor([session.prev]), session.h[None],
                    torch.tensor([session.mask]))
            session.h, session.prev = h[0], action
        self._observe(session, prompt_ids[len(prompt_ids) - f:])
        self._sessions[key] = session

    def extend(self, key: str, observation: str, observation_ids: list[int]) -> None:
        """Read the next observation's features."""
        self._observe(self._sessions[key], observation_ids)

    @torch.no_grad()
    def act(self, keys: Sequence[str]) -> list[ActionSample]:
        """One GRU step for every live episode together; one action each."""
        sessions = [self._sessions[k] for k in keys]
        feats = torch.tensor([s.features for s in sessions], dtype=torch.float32)
        prev = torch.tensor([s.prev for s in sessions], dtype=torch.long)
        mask = torch.tensor([s.mask for s in sessions], dtype=torch.bool)
        h = torch.stack([s.h for s in sessions])
        logp, _, h_new = self.model.step(feats, prev, h, mask)
        out = []
        for i, s in enumerate(sessions):
            a, lp = self._draw(logp[i].double(), s.rng)
            s.h, s.prev = h_new[i], a
            out.append(ActionSample(self.codec.action(a).model_text(), [a], [lp], [lp],
                                    "stop"))
        return out

    def _draw(self, logp_A: torch.Tensor, rng: random.Random) -> tuple[int, float]:
        if self.sampler.greedy:
            return int(logp_A.argmax()), 0.0
        u, total = rng.random(), 0.0
        probs = logp_A.exp().tolist()
        choice = max(i for i, p in enumerate(probs) if p > 0)
        for i, p in enumerate(probs):
            total += p
            if p > 0 and u < total:
                choice = i
                break
        return choice, min(float(logp_A[choice]), 0.0)

    def close(self, key: str) -> None:
        """Forget an episode."""
        self._sessions.pop(key, None)
