"""Length schedules (kv.schedule): the format (inline, JSON, YAML), the lookup, the budget re-read per sequence at
every decode step in ragged batches (block-sparse and eviction), the eviction bound under a growing budget, the
config keys, and every bad input."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparserl.config import ConfigError, load_config, save_config
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.schedule import BudgetSchedule, parse_schedule
from sparserl.errors import UserError
from sparserl.models import tiny_model


@functools.cache
def tiny():
    return tiny_model("llama", seed=0, num_layers=3)


def engine(kv: KVConfig) -> RolloutEngine:
    model, tok = tiny()
    e = RolloutEngine(model, tok, kv=kv)
    e.eos_ids = set()
    return e


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (n,), generator=g).tolist() for n in lengths]


def budget_at(table: list[list[int]], length: int) -> int:
    """The documented rule, by hand: the budget of the last bin starting at or before `length`."""
    return [budget for start, budget in table if start <= length][-1]


# --- format and lookup ----------------------------------------------------------------------------------------


def test_inline_json_and_yaml_forms_give_the_same_table(tmp_path):
    table = [[0, 256], [512, 384], [1024, 512]]
    (tmp_path / "s.json").write_text(json.dumps({"tau": 0.86, "schedule": table}))
    (tmp_path / "s.yaml").write_text("# calibrated\n- [0, 256]\n- [512, 384]\n- [1024, 512]\n")
    forms = [table, "[[0,256],[512,384],[1024,512]]", str(tmp_path / "s.json"), str(tmp_path / "s.yaml")]
    assert all(parse_schedule(form) == table for form in forms)
    assert parse_schedule(None) is None and parse_schedule("null") is None
    kv = KVConfig(method="rkv", schedule=str(tmp_path / "s.json"))
    assert kv.schedule == table and kv.max_budget == 512  # the config keeps the table read from the file


def test_a_schedule_file_of_another_method_is_warned_about(tmp_path, recwarn):
    table = [[0, 256], [512, 384]]
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps({"schedule": table, "method": "block_topk"}))  # as `sparserl calibrate` does
    expected = r"schedule\.json.*calibrated for method 'block_topk'.*used with 'rkv'"
    with pytest.warns(UserWarning, match=expected):
        assert KVConfig(method="rkv", schedule=str(path)).schedule == table
    recwarn.clear()
    KVConfig(method="block_topk", schedule=str(path))  # its own method, or an inline table: no warning
    KVConfig(method="rkv", schedule=table)
    assert not [w for w in recwarn if "calibrated for" in str(w.message)]


def test_lookup_at_the_bin_edges():
    sched = BudgetSchedule.from_table([[0, 256], [512, 384], [1024, 512]])
    lengths = torch.tensor([0, 1, 511, 512, 513, 1023, 1024, 9000])
    assert sched.budget(lengths).tolist() == [256, 256, 256, 384, 384, 384, 512, 512]
    assert BudgetSchedule.constant(80).budget(torch.tensor([1, 10_000])).tolist() == [80, 80]


@given(
    steps=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 50)), min_size=0, max_size=6),
    first=st.integers(1, 100),
    lengths=st.lists(st.integers(0, 2000), min_size=1, max_size=20),
)
def test_lookup_matches_the_rule(steps, first, lengths):
    table, start, budget = [[0, first]], 0, first
    for gap, growth in steps:
        start, budget = start + gap, budget + growth
        table.append([start, budget])
    got = BudgetSchedule.from_table(parse_schedule(table)).budget(torch.tensor(lengths)).tolist()
    assert got == [budget_at(table, n) for n in lengths]


# --- re-read per sequence at every step -----------------------------------------------------------------------


def test_block_topk_rereads_each_rows_budget_from_its_length():
    """Prompts of 20 and 70 tokens: at the same step the rows get different budgets, and each row's budget grows
    as it crosses 64 and 96 positions; pages read follow each row's own budget."""
    table = [[0, 48], [64, 80], [96, 112]]
    kv = KVConfig(method="block_topk", schedule=table, page_size=16, dense_layers=[0])
    e = engine(kv)
    seen = []

    def on_step(step, cache, samples):
        lengths = cache.length  # positions held after the step = total length (nothing is evicted)
        budgets = e.step_budget.tolist()
        assert budgets == [budget_at(table, n) for n in lengths.tolist()]
        pages = -(-lengths // 16)
        read = torch.where(pages * 16 > e.step_budget, lengths - (pages - e.step_budget // 16) * 16, lengths)
        assert e.sparse.plan.read.tolist() == read.tolist()
        seen.append(budgets)

    e.step_hooks.append(on_step)
    e.generate(random_prompts([20, 70], 0), n=1, max_new_tokens=40)
    assert seen[0] == [48, 80]  # 21 and 71 positions
    assert seen[-1] == [48, 112]  # 59 and 109 positions
    assert [48, 80] in seen and [48, 112] in seen


class EvictionSimulator:
    """Held positions per sample under the documented rule with a schedule: after prefill a prompt is cut to its
    budget at its length; after every interval-th step a sequence holding at least its budget (read at its length
    once the step's token is written) is cut so that it holds exactly that budget after the step."""

    def __init__(self, kv: KVConfig, table, prompt_lens, n):
        self.kv, self.table = kv, table
        self.prompt = [p for p in prompt_lens for _ in range(n)]
        self.held = [min(p, budget_at(table, p)) for p in self.prompt]
        self.bound = max(b for _, b in table) + kv.interval - 1
        self.cuts: list[list[int]] = [[] for _ in self.prompt]  # positions kept by each cut, per sample

    def __call__(self, step, cache, samples):
        assert int(cache.held().max()) <= self.bound and cache.capacity <= self.bound  # a shared prompt's too
        for row, s in enumerate(samples.tolist()):
            budget = budget_at(self.table, self.prompt[s] + step + 1)
            if (step + 1) % self.kv.interval == 0 and self.held[s] >= budget:
                self.held[s] = budget - 1
                self.cuts[s].append(self.held[s])
            self.held[s] += 1
            assert int(cache.held()[row]) == self.held[s], (step, s)


@pytest.mark.parametrize("method", ["snapkv", "streaming_llm", "h2o"])
def test_eviction_with_a_growing_schedule_keeps_more_at_the_next_cut(method):
    table = [[0, 16], [40, 24], [64, 40]]
    kv = KVConfig(method=method, schedule=table, window=4, interval=8, n_sink=2)
    e = engine(kv)
    check = EvictionSimulator(kv, table, [10, 50], n=2)
    e.step_hooks.append(check)
    out = e.generate(random_prompts([10, 50], 3), n=2, max_new_tokens=90)
    assert [cuts[0] < cuts[-1] for cuts in check.cuts] == [True] * 4  # later cuts keep more
    assert check.cuts[0][0] == 15 and check.cuts[0][-1] == 39
    assert out.stats["peak_kv_positions"] == 40 + 8 - 1  # the largest budget + interval - 1
    per_position = out.stats["kv_bytes_per_position"]
    # allocated for the new bound, plus the two prompts (10 positions; 50 cut to 24) once while rows read them
    prompts_held = (10 + 24) * e.share_prompts
    assert out.stats["peak_kv_bytes"] == (4 * (40 + 8 - 1) + prompts_held) * per_position
    assert [s.stats["compression_events"] > 0 for s in out] == [True] * 4


def test_a_constant_schedule_is_the_fixed_budget():
    prompts = random_prompts([12, 30], 5)
    fixed = engine(KVConfig(method="rkv", budget=24, window=4, interval=8)).generate(
        prompts, n=2, max_new_tokens=40
    )
    sched = KVConfig(method="rkv", schedule=[[0, 24]], window=4, interval=8)
    scheduled = engine(sched).generate(prompts, n=2, max_new_tokens=40)
    for a, b in zip(fixed, scheduled, strict=True):
        assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)


# --- config keys ----------------------------------------------------------------------------------------------


def test_config_accepts_block_topk_and_an_inline_schedule(tmp_path):
    cfg = load_config(None, ["kv.method=block_topk", "kv.schedule=[[0,256],[512,384],[1024,512]]"])
    assert cfg.sparse and cfg.kv.sparse_attention and not cfg.kv.evicting
    assert cfg.kv.schedule == [[0, 256], [512, 384], [1024, 512]] and cfg.kv.dense_layers == [0, 1]
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    (tmp_path / "run.yaml").write_text("kv:\n  method: rkv\n  schedule: [[0, 64], [128, 96]]\n")
    assert load_config(tmp_path / "run.yaml").kv.max_budget == 96
    assert not load_config(None, ["kv.method=block_topk", "algo.preset=dense"]).sparse


def test_sparse_presets_name_block_topk_when_the_kv_method_is_dense():
    with pytest.raises(ConfigError, match=r"kv.method='dense'.*block-sparse one \(block_topk\)"):
        load_config(None, ["kv.method=dense"])


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], r"kv.schedule is empty"),
        ("", r"kv.schedule is empty"),
        ([[0, 64], [100, 48], [200, 96]], r"bin 1 \(from length 100\) has budget 48, below bin 0's 64"),
        ([[0, 64], [100, 96], [200, 80]], r"bin 2 \(from length 200\) has budget 80, below bin 1's 96"),
        ([[10, 64]], r"bin 0 starts at length 10; the first bin must start at 0"),
        ([[0, 64], [100, 96], [100, 128]], r"bin 2 starts at length 100, not after bin 1 \(100\)"),
        ([[0, 64], [100]], r"bin 1 is \[100\]; each bin is a pair"),
        ([[0, "x"]], r"bin 0 is \[0, 'x'\]"),
        ({"bins": [[0, 64]]}, r"expected a table"),
        ("[[0, 64], [100", r"not a valid table"),
        ("no/such/schedule.json", r"kv.schedule: the schedule file 'no/such/schedule.json' does not exist"),
    ],
)
def test_bad_schedules_name_the_culprit(schedule, message):
    with pytest.raises(UserError, match=message):
        KVConfig(method="snapkv", schedule=schedule)


def test_a_bad_schedule_file_names_the_file(tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text('{"schedule": [[0, 64], [10, 32]]}')
    with pytest.raises(
        UserError, match=rf"kv.schedule \(file {bad}\): bin 1 \(from length 10\) has budget 32"
    ):
        KVConfig(method="rkv", schedule=str(bad))
    bad.write_text("{not json")
    with pytest.raises(UserError, match=rf"kv.schedule: {bad} is not valid JSON"):
        KVConfig(method="rkv", schedule=str(bad))


def test_eviction_budgets_in_a_schedule_must_exceed_the_window():
    with pytest.raises(
        UserError, match=r"kv.schedule bin 0 \(from length 0\): budget 8 must exceed .*window 8"
    ):
        KVConfig(method="rkv", schedule=[[0, 8], [100, 64]])


def test_config_errors_name_the_key_and_where_it_came_from():
    with pytest.raises(ConfigError, match=r"invalid .kv.: kv.schedule.*bin 1 \(from length 512\)"):
        load_config(None, ["kv.schedule=[[0,256],[512,128]]"])
