"""`carpool simulate`: compare static and continuous batching on a workload, no model needed."""

from __future__ import annotations

import argparse
import json

from carpool.sim.simulator import SimSettings, simulate
from carpool.sim.workload import SCENARIOS, STEP_S, LinearCostModel, Scenario, load_workload

DEFAULT_SLOTS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                        help="a built-in scenario (default: classic-5)")
    source.add_argument("--workload", metavar="FILE.jsonl",
                        help='one request a line: {"arrival_s", "prompt_tokens", "output_tokens"}')
    parser.add_argument("--cost-a", type=float, default=None,
                        help=f"seconds per step (default: the scenario's, {STEP_S})")
    parser.add_argument("--cost-b", type=float, default=None,
                        help="seconds per batched token (default: the scenario's, 0)")
    parser.add_argument("--slots", type=int, default=None,
                        help="max_num_seqs, the batch's slots (default: the scenario's, "
                             f"{DEFAULT_SLOTS})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool size (default: every slot can hold the longest request)")
    parser.add_argument("--preemption-policy", choices=("newest", "least_work"), default="newest")
    parser.add_argument("--timeline-rows", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the slot timelines")


def build_scenario(args: argparse.Namespace) -> Scenario:
    if args.workload:
        cost = LinearCostModel(STEP_S if args.cost_a is None else args.cost_a, args.cost_b or 0.0)
        return load_workload(args.workload, args.slots or DEFAULT_SLOTS, cost)
    scenario = SCENARIOS[args.scenario or "classic-5"]()
    cost = LinearCostModel(scenario.cost.a if args.cost_a is None else args.cost_a,
                           scenario.cost.b if args.cost_b is None else args.cost_b)
    return Scenario(scenario.name, scenario.requests, args.slots or scenario.num_slots, cost)


def run(args: argparse.Namespace) -> int:
    from carpool.sim.report import to_json, to_text

    if args.slots is not None and args.slots < 1:
        raise SystemExit("carpool simulate: --slots must be >= 1")
    try:
        scenario = build_scenario(args)
        settings = SimSettings(max_num_batched_tokens=args.max_num_batched_tokens,
                               block_size=args.block_size, num_blocks=args.num_blocks,
                               preemption_policy=args.preemption_policy)
        results = {kind: simulate(kind, scenario, settings) for kind in ("static", "continuous")}
    except (ValueError, OSError) as error:
        raise SystemExit(f"carpool simulate: {error}") from None
    if args.json:
        print(json.dumps(to_json(results), indent=2))
    else:
        print(to_text(scenario, results, args.timeline_rows))
    if args.plot:
        from carpool.sim.plot import plot_timelines

        plot_timelines(results, args.plot)
        if not args.json:
            print(f"timeline plot written to {args.plot}")
    return 0
