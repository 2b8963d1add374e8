"""Record factories shared by tests: valid turn and trajectory records to mutate."""

from closedloop.contracts import (
    SamplerConfig,
    Termination,
    TrajectoryRecord,
    TurnRecord,
    sha256_hex,
)

SAMPLER = SamplerConfig(temperature=1.0, top_p=1.0)
H = sha256_hex("x")


def make_turn(turn=0, prompt=(1, 2, 3), action=(4, 5), context_len=3, version="v0000", **kw):
    values = dict(
        run_id="run", episode_id="ep", group_id="g", task_id="json-repair-v1/a/000-x", seed=11,
        env_version="terminal-repair-v1", base_snapshot_id="snap", behavior_policy_version=version,
        policy_manifest_hash=H, behavior_weight_checksum=H, generator_build="hf",
        turn=turn, snapshot_before=None, state_before=H, context_segment_id=0,
        memory_state_ref=None, compactor_version=None, prompt_token_ids=list(prompt),
        prompt_is_delta=turn > 0, context_len_before=context_len,
        action_token_ids=list(action), sampler_config=SAMPLER,
        behavior_logprobs=[-0.5] * len(action), raw_model_logprobs=[-0.4] * len(action),
        action_mask=[1] * len(action), action_text="<tool_call>{}</tool_call>",
        action_kind="tool", parse_error=None, generation_finish="stop", tool_name="read_file",
        tool_args={"path": "a"}, observation="ok", observation_error=None, state_after=H,
        reward_components=None, termination_reason=None, continuation_parent=None,
        timings={"decode_s": 0.1})
    values.update(kw)
    return TurnRecord(**values)


def make_traj(num_turns=2, termination=Termination.AGENT_FINISH, reward=None, **kw):
    values = dict(
        run_id="run", episode_id="ep", group_id="g", sample_index=0,
        task_id="json-repair-v1/a/000-x", task_family="json-repair-v1", split="train", seed=11,
        env_version="terminal-repair-v1", base_snapshot_id="snap", behavior_policy_version="v0000",
        policy_manifest_hash=H, behavior_weight_checksum=H, sampler_config=SAMPLER,
        num_turns=num_turns, num_action_tokens=4, termination=termination,
        reward=reward if reward is not None or termination.is_censored else {"task_success": 1.0},
        verifier_version="verifier-v1", final_state_hash=H, quarantine_reason=None,
        mixed_policy=False, rollout_started_at="t0", rollout_finished_at="t1")
    values.update(kw)
    return TrajectoryRecord(**values)
