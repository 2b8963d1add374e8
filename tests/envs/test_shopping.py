"""The shopping simulator (seed 001): check_env with fork checks, exactly one fitting item per
task, recovery from a wrong item, a hidden constraint-checked outcome, adjudicated fixtures."""

import pytest

from closedloop.contracts import Action, Termination
from closedloop.contracts.package import TaskSetRequest
from closedloop.envs.check import check_package
from closedloop.envs.discovery import resolve_package
from closedloop.envs.shopping import CATALOG, ShoppingExpert, satisfies
from closedloop.envs.shopping.package import shopping_package
from closedloop.envs.shopping.rules import price_of, world_catalog
from closedloop.envs.verifier_audit import audit_verifier

PKG = shopping_package()


def test_check_package_runs_the_envs_own_actions_and_fork_checks():
    tasks = [CATALOG.generate("shopping-v1", t, 1).task_id
             for t in ("backpack", "tent", "headlamp")]
    report = check_package(PKG, tasks, seeds=(0, 5), n_random_sequences=3)
    assert report.fork_checks == 6 and report.missing == ()
    assert report.sampler_actions > 150
    assert resolve_package("shopping-v1") is PKG


def test_every_task_has_exactly_one_item_meeting_the_request():
    for task_id in CATALOG.task_ids("train") + CATALOG.task_ids("heldout"):
        task = CATALOG.task(task_id)
        want = task.hidden["want"]
        fits = [item for item in task.public["catalog"]
                if satisfies(item, want["color"], want["size"], want)[0]]
        assert len(fits) == 1, task_id
        same = [i for i in task.public["catalog"] if i["category"] == want["category"]]
        assert len(same) == 8  # the fitting item and seven decoys


def test_the_seed_reassigns_item_ids_but_not_items():
    task = CATALOG.task(CATALOG.task_ids("train")[0])
    a, b = world_catalog(task.public, 0), world_catalog(task.public, 1)
    assert [i["id"] for i in a] != [i["id"] for i in b]
    assert [{k: v for k, v in i.items() if k != "id"} for i in a] == \
           [{k: v for k, v in i.items() if k != "id"} for i in b]


def _episode(task_id: str, seed: int, policy) -> tuple:
    env = PKG.make_env()
    obs = env.reset(task_id, seed)
    texts = []
    for _ in range(30):
        action = policy.act(obs)
        texts.append(action)
        t = env.step(action)
        obs = t.observation
        if t.done:
            break
    return env, t, texts


def test_the_expert_solves_and_the_noisy_expert_recovers():
    verifier = PKG.verifier()
    sets = PKG.task_sets(TaskSetRequest(16, 8))
    recovered = 0
    for i, task_id in enumerate(sets.train + sets.heldout):
        env, _, _ = _episode(task_id, i, ShoppingExpert(i))
        assert verifier.score_or_quarantine(task_id, env.export_state()).success == 1.0
        env, _, texts = _episode(task_id, i, ShoppingExpert(i, 0.3))
        result = verifier.score_or_quarantine(task_id, env.export_state())
        backs = sum(isinstance(a, Action) and a.name == "back" for a in texts)
        recovered += result.success == 1.0 and backs > 0
    assert recovered >= 5


def test_buy_is_final_and_says_nothing_about_the_request():
    task = CATALOG.task(CATALOG.task_ids("train")[2])
    want = task.hidden["want"]
    env = PKG.make_env()
    env.reset(task.task_id, 0)
    decoy = next(i for i in env.current_state().world()["catalog"]
                 if i["category"] == want["category"]
                 and not satisfies(i, want["color"], want["size"], want)[0])
    t = env.step(Action.tool("buy"))
    assert t.error == "no_item_open"
    env.step(Action.tool("open_item", item_id=decoy["id"]))
    t = env.step(Action.tool("buy"))
    assert t.error == "options_missing"
    env.step(Action.tool("select", option="color", value=decoy["colors"][0]))
    env.step(Action.tool("select", option="size", value=decoy["sizes"][0]))
    t = env.step(Action.tool("buy"))
    assert t.done and t.termination is Termination.AGENT_FINISH
    assert t.observation.startswith("Order placed") and "request" not in t.observation
    paid = env.current_state().world()["purchase"]["price"]
    assert paid == price_of(decoy, decoy["sizes"][0])
    result = PKG.verifier().score_or_quarantine(task.task_id, env.export_state())
    assert result.success == 0.0 and result.reward["purchased"] == 1.0


def test_back_and_search_errors():
    task_id = CATALOG.task_ids("train")[0]
    env = PKG.make_env()
    env.reset(task_id, 0)
    assert env.step(Action.tool("back")).error == "no_results"
    assert env.step(Action.tool("open_item", item_id="item_00")).error == "not_found"
    assert env.step(Action.tool("search", query="")).observation.startswith("No results")
    assert env.step(Action.tool("select", option="color", value="red")).error == "no_item_open"
    assert env.step(Action.tool("search")).error == "bad_arguments"


def test_surcharge_decoys_fail_only_on_price():
    task = CATALOG.task(CATALOG.task_ids("train")[0])
    want = task.hidden["want"]
    surcharged = [i for i in task.public["catalog"] if i["category"] == want["category"]
                  and i["price"] <= want["max_price"]
                  and i["size_extra"].get(want["size"], 0) == 10]
    assert surcharged
    assert satisfies(surcharged[0], want["color"], want["size"], want) == (False, ["price"])


def test_verifier_agrees_with_every_adjudicated_fixture():
    fixtures = PKG.fixtures(None)
    assert len(fixtures) == 18 * 6
    audit = audit_verifier(fixtures, PKG.verifier())
    assert (audit.fp, audit.fn, audit.tamper_missed, audit.false_quarantine) == (0, 0, 0, 0)
    assert audit.fp_ci[1] <= 0.1 and audit.fn_ci[1] <= 0.15  # the gate's bounds


@pytest.mark.parametrize("edit", ["catalog", "item"])
def test_tampered_catalogs_and_purchases_are_unscored(edit):
    from closedloop.envs.sim.fixtures import tampered_fixture

    gold = next(f for f in PKG.fixtures(None) if f.kind == "gold")
    change = ((lambda w: {**w, "catalog": w["catalog"][1:]}) if edit == "catalog" else
              (lambda w: {**w, "purchase": {**w["purchase"], "item": "item_00"}}))
    fx = tampered_fixture(gold, change, edit)
    result = PKG.verifier().score_or_quarantine(fx.task_id, fx.final_state)
    assert result.reward is None and result.quarantine_reason.startswith("tamper_detected")
