"""The capacity study's report: the learning rate chosen per model, the tables and the checks.

Reads the `records.json` of every finished run under `<out>/runs/` (tools/repro_run.py) and
builds `results.json` / `results.md`:
- per model (lalte_jax/configs/repro/capacity.py MODELS) the learning rate with the best capped
  accuracy on the held-out "select" split among its seed-0 sweep runs (uncapped for a run whose
  router was off), once every learning rate of the sweep has finished;
- the main table: test accuracy at that lr over the seeds (mean, std, each seed), capped and
  uncapped, and for LTE models availability, retention and kept counts; the P = 8 control;
- the acceptance checks of the study and the falsification checks (`checks`), each "pass",
  "fail" or "missing" (not enough runs yet) with the numbers it compared;
- per run, from its `metrics.jsonl`, how training went (`training_milestones`): the step at which
  the answers' cross-entropy first fell clearly below the plateau of a uniform guess among the
  values, its lowest and final values, and the largest sparsity weight lambda of an LTE model.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics

from lalte_jax.configs.repro import capacity

RUNS_DIR, RUN_FILE = "runs", "run.json"
LTE_MODELS = ("lalte",) + capacity.WARMUP_MODELS + ("lalte_bounded",)


# A run has left the plateau once its answers' cross-entropy is this far below ln(#values).
PLATEAU_MARGIN = 0.3


TRAJECTORY_EVERY = 1000  # steps between the rows of a run's trajectory
SWITCH_SPAN = (100, 3000)  # every logged step from 100 before to 3000 after a router warm-up's end
TRAJECTORY_FIELDS = (f"training curves from each run's metrics.jsonl: every {TRAJECTORY_EVERY}"
                     f" steps, every logged step from {SWITCH_SPAN[0]} before to {SWITCH_SPAN[1]}"
                     " after the end of a router warm-up, and the last; ce_loss, lte_retained"
                     " (tokens with score > 0 per LTE layer and KV head, batch mean, router"
                     " dropout on), lte_lambda")


def read_spec(run_dir: pathlib.Path) -> tuple[capacity.RunSpec, bool]:
  """(the RunSpec, smoke) stored in `run_dir/run.json` (tools/repro_run.py writes it)."""
  data = json.loads((run_dir / RUN_FILE).read_text())
  smoke = bool(data.pop("smoke", False))
  return capacity.RunSpec(**data), smoke


def record_spec(record: dict) -> capacity.RunSpec:
  """The RunSpec a run's records.json (or its entry in results.json) describes."""
  return capacity.RunSpec(record["model"], record["lr"], record["seed"], record["pairs"],
                          record["steps"])


def warmup_end(spec: capacity.RunSpec, smoke: bool) -> int:
  """The step at which the run's router warm-up ends (0: it has none)."""
  return capacity.study_config(spec, smoke=smoke).lte_routing_freeze_steps


def near_switch(step: int, freeze: int) -> bool:
  """Whether `step` lies in SWITCH_SPAN around the end `freeze` of a router warm-up."""
  return freeze - SWITCH_SPAN[0] <= step <= freeze + SWITCH_SPAN[1]


def _metric_rows(run_dir: pathlib.Path) -> list[dict]:
  """The training records (those with ce_loss) of a run's metrics.jsonl; [] when it is absent."""
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    return []
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in rows if "ce_loss" in r]


def trajectory(run_dir: pathlib.Path) -> list[dict]:
  """A run's training curve from its metrics.jsonl: the records at every TRAJECTORY_EVERY steps,
  at every logged step of SWITCH_SPAN around the end of its router warm-up (if it has one) and
  the last, each as {step, ce_loss, lte_retained, lte_lambda} ([] for models without LTE)."""
  rows = _metric_rows(run_dir)
  if not rows or not (run_dir / RUN_FILE).is_file():
    return []
  spec, smoke = read_spec(run_dir)
  freeze = warmup_end(spec, smoke)
  has_switch = 0 < freeze < spec.steps
  kept = [r for r in rows if r["step"] % TRAJECTORY_EVERY == 0
          or (has_switch and near_switch(r["step"], freeze))]
  if kept[-1:] != rows[-1:]:
    kept.append(rows[-1])
  return [{"step": r["step"], "ce_loss": round(r["ce_loss"], 4),
           "lte_retained": r.get("lte_retained", []), "lte_lambda": r.get("lte_lambda", [])}
          for r in kept]


def training_milestones(run_dir: pathlib.Path) -> dict:
  """How a run's training went, from its metrics.jsonl and run.json ({} when either is missing):
  `plateau` = ln(number of values), the loss of a uniform guess among them; `left_plateau_step`
  = the first logged step with ce_loss < plateau - PLATEAU_MARGIN (None: never); the lowest and
  final ce_loss; `max_lambda` = the largest sparsity weight of any LTE layer and head (None for
  models without one)."""
  rows = _metric_rows(run_dir)
  if not rows or not (run_dir / RUN_FILE).is_file():
    return {}
  spec, smoke = read_spec(run_dir)
  vocab = capacity.model_overrides(spec.model, smoke=smoke)["vocab_size"]
  plateau = math.log(vocab // 2)  # MQARSource: values are the upper half of the vocabulary
  left = next((r["step"] for r in rows if r["ce_loss"] < plateau - PLATEAU_MARGIN), None)
  lambdas = [v for r in rows for layer in r.get("lte_lambda") or () for v in layer]
  return {"plateau": plateau, "left_plateau_step": left,
          "min_ce_loss": min(r["ce_loss"] for r in rows), "final_ce_loss": rows[-1]["ce_loss"],
          "max_lambda": max(lambdas) if lambdas else None}


def load_records(out: pathlib.Path) -> list[dict]:
  """Every finished run's records under `out/runs`, in name order, each with its
  `training_milestones` under "milestones"; a run restored from published data
  (`tools/repro_state.py restore`, "restored" in its records) keeps its published ones."""
  records = []
  for path in sorted((out / RUNS_DIR).glob("*/records.json")):
    record = json.loads(path.read_text())
    if record.get("restored"):
      # Its metrics.jsonl is only the published trajectory (a row every TRAJECTORY_EVERY steps
      # outside a warm-up's switch): computed from it, left_plateau_step would be rounded up to
      # the next such row and min_ce_loss taken over those rows alone.
      record.setdefault("milestones", {})
    else:
      record["milestones"] = training_milestones(path.parent)
    records.append(record)
  return records


def headline_accuracy(split: dict) -> float:
  """A split's capped accuracy, or the uncapped one for a run without a cap (router off)."""
  return split.get("capped_accuracy", split["uncapped_accuracy"])


def selection_accuracy(record: dict) -> float:
  return headline_accuracy(record["select"])


def accuracy_by_lr_seed(records: list[dict], model: str) -> dict[float, dict[int, float]]:
  """{lr: {seed: test accuracy}} of `model`'s P = 96 runs."""
  table = {}
  for r in records:
    if r["model"] == model and r["pairs"] == capacity.NUM_KV_PAIRS:
      table.setdefault(r["lr"], {})[r["seed"]] = headline_accuracy(r["test"])
  return table


def choose_lrs(records: list[dict], models, lrs, pairs: int, steps: int) -> dict[str, float]:
  """{model: lr} for the models whose seed-0 runs at every lr of `lrs` have finished (a fork's:
  its parent's); with a
  single lr there is nothing to choose, so every model has it from the start (its seeds need not
  wait for the seed-0 run)."""
  if len(lrs) == 1:
    return {model: lrs[0] for model in models}
  chosen = {}
  for model in models:
    own = capacity.FORKS.get(model, model)  # a fork trains at its parent's lr
    sweep = {r["lr"]: r for r in records if r["model"] == own and r["seed"] == 0
             and r["pairs"] == pairs and r["steps"] == steps}
    if all(lr in sweep for lr in lrs):
      chosen[model] = max(lrs, key=lambda lr: selection_accuracy(sweep[lr]))
  return chosen


def _stats(values: list[float]) -> dict:
  return {"mean": statistics.fmean(values), "std": statistics.pstdev(values),
          "values": values} if values else {}


def _mean_lh(rows) -> float:
  """Mean of a [L][H] list."""
  return statistics.fmean(v for row in rows for v in row)


def model_row(model: str, lr: float, runs: list[dict], controls: list[dict]) -> dict:
  """The main-table row of `model` from its test records at the chosen lr."""
  tests = [r["test"] for r in runs]
  row = {"model": model, "lr": lr, "seeds": sorted(r["seed"] for r in runs),
         "capped": _stats([t["capped_accuracy"] for t in tests if "capped_accuracy" in t]),
         "uncapped": _stats([t["uncapped_accuracy"] for t in tests]),
         "control": _stats([c["test"].get("capped_accuracy", c["test"]["uncapped_accuracy"])
                            for c in controls])}
  if tests and "availability_capped" in tests[0]:
    row.update(
        availability_capped=_stats([t["availability_capped"] for t in tests]),
        availability_uncapped=_stats([t["availability_uncapped"] for t in tests]),
        filler_retention=_stats([100 * _mean_lh(t["filler_retention"]) for t in tests]),
        value_retention=_stats([100 * _mean_lh(t["value_retention"]) for t in tests]),
        kept_count_max=max(max(max(row) for row in t["kept_count_max"]) for t in tests),
        free_slots=tests[0]["free_slots"])
  return row


def _check(name: str, ok: bool | None, detail: str) -> dict:
  return {"check": name, "status": "missing" if ok is None else ("pass" if ok else "fail"),
          "detail": detail}


def _mean(row: dict | None, key: str) -> float | None:
  return (row or {}).get(key, {}).get("mean")


def acceptance_checks(rows: dict[str, dict]) -> list[dict]:
  """The study's targets on the main table (means over the seeds at the chosen lr)."""
  attn, swa = _mean(rows.get("gdn_attn"), "capped"), _mean(rows.get("gdn_swa"), "capped")
  checks = [
      _check("GDN+Attn >= 90% (long-gap P=96)", None if attn is None else attn >= 90,
             f"{attn}"),
      _check("GDN+SWA <= 40% at laLTE's cache budget", None if swa is None else swa <= 40,
             f"{swa}"),
  ]
  for model in LTE_MODELS:
    row = rows.get(model)
    capped, uncapped = _mean(row, "capped"), _mean(row, "uncapped")
    available, filler = _mean(row, "availability_capped"), _mean(row, "filler_retention")
    checks += [
        _check(f"{model} within 10 points of GDN+Attn (capped)",
               None if None in (capped, attn) else attn - capped <= 10, f"{capped} vs {attn}"),
        _check(f"{model} capped within 3 points of uncapped",
               None if None in (capped, uncapped) else uncapped - capped <= 3,
               f"{capped} vs {uncapped}"),
        _check(f"{model} availability >= 90%", None if available is None else available >= 90,
               f"{available}"),
        _check(f"{model} filler retention <= 10%", None if filler is None else filler <= 10,
               f"{filler}"),
    ]
  controls = {model: _mean(rows[model], "control") if model in rows else None
              for model in capacity.CONTROL_MODELS}
  missing = [m for m in capacity.CONTROL_MODELS if controls[m] is None]
  checks.append(_check("P=8 control >= 90% for every model of the main table",
                       None if missing else all(v >= 90 for v in controls.values()),
                       json.dumps(controls)))
  return checks


def _warmup_checks(model: str, runs: list[dict]) -> list[dict]:
  """The router checks of a warm-up model, on its first seed: at the switch, dCE/dscore < 0 on
  the queried values of every head; at the end, values retained more than fillers."""
  if not runs:
    return [_check(f"{model}: after the warm-up, dCE/dscore < 0 on queried values (every head)",
                   None, f"needs a finished {model} run")]
  record = min(runs, key=lambda r: (r["seed"], r["lr"]))
  steps = sorted(int(k) for k in record["probes"])
  switch = min((s for s in steps if s > 1), default=None)
  first, last = record["probes"][str(switch)], record["probes"][str(steps[-1])]
  negative = all(v < 0 for row in first["dscore_value"] for v in row)
  higher = all(v > f for rv, rf in zip(last["retained_value"], last["retained_filler"])
               for v, f in zip(rv, rf))
  return [_check(f"{model}: after the warm-up, dCE/dscore < 0 on queried values (every head)",
                 negative, f"{record['name']} step {switch}: value {first['dscore_value']},"
                 f" filler {first['dscore_filler']}"),
          _check(f"{model}: queried values retained more than fillers (every head)", higher,
                 f"{record['name']} step {steps[-1]}: value {last['retained_value']},"
                 f" filler {last['retained_filler']}")]


def falsification_checks(records: list[dict], rows: dict[str, dict]) -> list[dict]:
  """Where laLTE could fail for a wrong implementation rather than for the setting."""
  checks = []
  name = "router off (every token kept) equals GDN+Attn within 3 points (mean over common seeds)"
  attn = accuracy_by_lr_seed(records, "gdn_attn")
  off = accuracy_by_lr_seed(records, capacity.ROUTER_OFF)
  means = {}
  for lr in set(attn) & set(off):
    seeds = sorted(set(attn[lr]) & set(off[lr]))
    if seeds:
      means[lr] = (statistics.fmean(off[lr][s] for s in seeds),
                   statistics.fmean(attn[lr][s] for s in seeds), seeds)
  if means:
    best = max(means, key=lambda lr: means[lr][1])
    off_mean, attn_mean, seeds = means[best]
    checks.append(_check(name, abs(off_mean - attn_mean) <= 3,
                         f"lr {best:g}, seeds {seeds}: {off_mean:.1f} vs {attn_mean:.1f}"))
  else:
    checks.append(_check(name, None, "needs lalte_router_off and gdn_attn at one lr and seed"))
  for model in capacity.WARMUP_MODELS:
    checks += _warmup_checks(model, [r for r in records if r["model"] == model
                                     and r.get("probes")])
  for model in LTE_MODELS:
    row = rows.get(model)
    available = _mean(row, "availability_capped")
    capped, uncapped = _mean(row, "capped"), _mean(row, "uncapped")
    broken = None if None in (available, capped, uncapped) else (
        available >= 95 and uncapped - capped > 10)
    checks.append(_check(f"{model}: no high availability (>= 95%) with capped far (> 10) below"
                         " uncapped", None if broken is None else not broken,
                         f"availability {available}, capped {capped}, uncapped {uncapped}"))
  return checks


def summarize(records: list[dict], *, models, lrs, seeds, steps: int,
              control_steps: int) -> dict:
  """The payload of results.json: chosen lrs, main-table rows, every run, the checks."""
  pairs = capacity.NUM_KV_PAIRS
  chosen = choose_lrs(records, models, lrs, pairs, steps)
  rows = {}
  for model, lr in chosen.items():
    runs = [r for r in records if r["model"] == model and r["lr"] == lr and r["pairs"] == pairs
            and r["steps"] == steps and r["seed"] in seeds]
    controls = [r for r in records if r["model"] == model and r["lr"] == lr
                and r["pairs"] == capacity.CONTROL_KV_PAIRS and r["steps"] == control_steps]
    rows[model] = model_row(model, lr, runs, controls)
  return {"chosen_lr": chosen, "rows": rows, "runs": records,
          "checks": acceptance_checks(rows) + falsification_checks(records, rows)}


def _cell(stats: dict | None, digits: int = 1) -> str:
  if not stats:
    return "–"
  if len(stats["values"]) == 1:
    return f"{stats['mean']:.{digits}f}"
  return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def _table(headers: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _accuracy(split: dict, key: str) -> str:
  return f"{split[key]:.1f}" if key in split else "–"


def markdown(payload: dict, device: str) -> str:
  """results.md: the main table, the checks, every run, the gradient probes."""
  main = _table(
      ["model", "lr", "seeds", "capped %", "uncapped %", "availability % (capped)",
       "filler retention %", "value retention %", "max kept / free slots", "control P=8 %"],
      [[r["model"], f"{r['lr']:g}", ",".join(map(str, r["seeds"])), _cell(r["capped"]),
        _cell(r["uncapped"]), _cell(r.get("availability_capped")),
        _cell(r.get("filler_retention")), _cell(r.get("value_retention")),
        f"{r['kept_count_max']} / {r['free_slots']}" if "free_slots" in r else "–",
        _cell(r["control"])] for r in payload["rows"].values()])
  checks = _table(["check", "status", "numbers"],
                  [[c["check"], c["status"], c["detail"]] for c in payload["checks"]])
  runs = _table(
      ["run", "select capped", "select uncapped", "test capped", "test uncapped",
       "availability (test, capped)", "availability with successor (test, capped)",
       "left plateau at step", "min / final CE", "max lambda", "train s", "step s"],
      [[r["name"], _accuracy(r["select"], "capped_accuracy"),
        _accuracy(r["select"], "uncapped_accuracy"), _accuracy(r["test"], "capped_accuracy"),
        _accuracy(r["test"], "uncapped_accuracy"), _accuracy(r["test"], "availability_capped"),
        _accuracy(r["test"], "availability_with_successor_capped"),
        *_milestone_cells(r.get("milestones") or {}), r["train"]["train_s"],
        _seconds(r["train"].get("step_time_s"))] for r in payload["runs"]])
  probes = _table(
      ["run", "step", "dCE/dscore values", "dCE/dscore values, norms' scale held",
       "dCE/dscore successors", "dCE/dscore fillers", "retained values", "retained successors",
       "retained fillers"],
      [[r["name"], step, _round(p["dscore_value"]), _round(p.get("dscore_value_held_norm")),
        _round(p.get("dscore_successor")),
        _round(p["dscore_filler"]), _round(p["retained_value"]),
        _round(p.get("retained_successor")), _round(p["retained_filler"])]
       for r in payload["runs"] for step, p in sorted(r.get("probes", {}).items(),
                                                      key=lambda item: int(item[0]))])
  chosen = ", ".join(f"{m} {lr:g}" for m, lr in payload["chosen_lr"].items()) or "none yet"
  smoke = (" Smoke scale (capacity.SMOKE, shrunk models and data): a check of the pipeline, not"
           " a result." if payload.get("smoke") else "")
  return (f"# Capacity study (lalte_jax/configs/repro/capacity.py)\n\nDevice: {device}.{smoke}"
          f" Long-gap MQAR, P = {capacity.NUM_KV_PAIRS} pairs at T = {capacity.SEQ_LEN}, every"
          " query beyond every window; accuracy (%) over the test queries, capped = the cached"
          " inference path (cap enforced), uncapped = the training-time forward. Learning rate"
          f" chosen per model on the held-out select split (capped): {chosen}.\n\n{main}\n\n"
          f"## Checks\n\n{checks}\n\n## Every run\n\n{runs}\n\n## dCE/dscore and retention"
          f" (per LTE layer and KV head)\n\n{probes}\n")


def _milestone_cells(milestones: dict) -> list[str]:
  if not milestones:
    return ["–"] * 3
  left = milestones["left_plateau_step"]
  lam = milestones["max_lambda"]
  return ["never" if left is None else str(left),
          f"{milestones['min_ce_loss']:.2f} / {milestones['final_ce_loss']:.2f}",
          "–" if lam is None else f"{lam:.2g}"]


def _seconds(value) -> str:
  return "–" if value is None else f"{value:.4f}"


def _round(rows) -> str:
  if rows is None:  # a record from before the quantity was measured
    return "–"
  return json.dumps([[float(f"{v:.3g}") for v in row] for row in rows])
