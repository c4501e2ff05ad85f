"""`carpool serve` with faults a test can trigger over HTTP (run as a script by the tests).

The engine is the real one; only this launcher adds a step hook. A request
whose prompt is exactly `STEP_FAULT_PROMPT` (token ids) makes the step that
schedules it raise inside the model call — a fault the engine contains. One
whose prompt is `LOOP_FAULT_PROMPT` breaks the scheduler, which the step loop
cannot contain: the server must report 503 and exit non-zero. Every step
that holds a request whose prompt starts with `SLOW_PROMPT` sleeps
`SLOW_STEP_S` first, so a test can keep a request in flight for as long as
it needs, whatever the machine's speed.
"""

from __future__ import annotations

import sys
import time

STEP_FAULT_PROMPT = [7, 7, 7, 7, 7, 7, 7, 13]
LOOP_FAULT_PROMPT = [7, 7, 7, 7, 7, 7, 7, 14]
SLOW_PROMPT = [7, 7, 7, 7, 7, 7, 7, 15]
SLOW_STEP_S = 0.05


def _prompts(engine, scheduler_output) -> list[list[int]]:
    states = engine._states
    return [states[s.request_id].request.prompt_token_ids
            for s in scheduler_output.scheduled if s.request_id in states]


def install_faults(engine) -> None:
    def hook(scheduler_output) -> None:
        prompts = _prompts(engine, scheduler_output)
        if any(p[:len(SLOW_PROMPT)] == SLOW_PROMPT for p in prompts):
            time.sleep(SLOW_STEP_S)
        if LOOP_FAULT_PROMPT in prompts:
            def broken_schedule():
                raise RuntimeError("injected step-loop fault")
            engine.scheduler.schedule = broken_schedule
        if STEP_FAULT_PROMPT in prompts:
            raise RuntimeError("injected step fault")

    engine.step_hook = hook


def patch_engine_loading() -> None:
    """Every `LLMEngine.from_config` gets the faults. Run on import by this script as
    `__main__` and, in the engine-core process `multiprocessing` spawns, as `__mp_main__`."""
    from carpool.engine.llm_engine import LLMEngine

    load = LLMEngine.from_config.__func__

    def from_config(cls, config, **kwargs):
        engine = load(cls, config, **kwargs)
        install_faults(engine)
        return engine

    LLMEngine.from_config = classmethod(from_config)


def main(argv: list[str]) -> int:
    from carpool.cli import main as cli_main
    return cli_main(argv)


if __name__ in ("__main__", "__mp_main__"):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    patch_engine_loading()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
