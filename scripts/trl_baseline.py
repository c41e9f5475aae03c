"""The standard trainer on our task: TRL's GRPOTrainer, set up as its documentation sets it up,
on the model, prompts, reward and hyper-parameters of an async-rlhf config, for a side-by-side
comparison with `async-rlhf train` on the same config.

    pip install -e ".[baseline]"        # TRL 1.16 and accelerate
    python scripts/trl_baseline.py --config configs/bench.yaml --steps 14 --out runs/trl

TRL runs colocated and synchronous: it generates a batch with transformers' `generate`, scores it,
then trains on it, on every core, in its default precision (bf16 autocast; `--no-bf16` for fp32).
Each optimizer step takes learner.batch_size completions (learner.micro_batch per forward, the
rest by gradient accumulation), generator.group_size per prompt, at the config's learning rate,
temperature and response length, with no KL term (TRL's default beta = 0, as ours). Prints one
line per step and writes OUT/trl.json: seconds since the command at each step, its batch reward,
the steady samples/s (after --warmup steps) and the time to a batch reward >= --target.
`async-rlhf plot runs/ours runs/trl` draws that batch reward beside a train run's (reward.png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from actors.model_init import ensure_model
from actors.tasks import examples, get_task
from async_rlhf.config import load_config
from async_rlhf.procs import process_age_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the steady rate")
    parser.add_argument("--target", type=float, default=0.9, help="the batch reward to time")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 (TRL's default is bf16)")
    parser.add_argument("--out", default="runs/trl")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(args.config)
    if cfg.data.source != "task":
        raise SystemExit(f"{args.config}: data.source must be task for this baseline, got {cfg.data.source}")
    model = str(ensure_model(cfg.model.path, cfg.model.preset, seed=cfg.seed, tokenizer=cfg.model.tokenizer))
    task = get_task(cfg.data.task)
    pairs = examples(cfg.data.task, cfg.seed, args.steps * cfg.learner.batch_size // cfg.generator.group_size)
    data = Dataset.from_dict({"prompt": [p for p, _ in pairs], "answer": [a for _, a in pairs]})

    def reward(prompts, completions, answer, **_):
        return [task.reward(c, a) for c, a in zip(completions, answer)]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                steps.append({"step": state.global_step, "t": round(process_age_s(), 2), "reward": logs["reward"]})
                print(f"step {state.global_step:3d}  reward {logs['reward']:.3f}  t {steps[-1]['t']:.1f}s", flush=True)

    micro = cfg.learner.micro_batch
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        train_dataset=data,
        args=GRPOConfig(
            output_dir=str(out / "trainer"), use_cpu=True, bf16=not args.no_bf16, max_steps=args.steps,
            per_device_train_batch_size=micro, gradient_accumulation_steps=cfg.learner.batch_size // micro,
            num_generations=cfg.generator.group_size, max_completion_length=cfg.generator.max_new_tokens,
            temperature=cfg.generator.temperature, learning_rate=cfg.learner.lr, gradient_checkpointing=False,
            logging_steps=1, report_to=[], save_strategy="no", seed=cfg.seed),
        callbacks=[Timer()],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    timed = [s for s in steps if s["step"] > args.warmup]
    rate = (len(timed) - 1) * cfg.learner.batch_size / (timed[-1]["t"] - timed[0]["t"]) if len(timed) > 1 else None
    reached = next((s["t"] for s in steps if s["reward"] >= args.target), None)
    result = {"config": args.config, "bf16": not args.no_bf16, "steps": steps, "samples_per_s": rate,
              "first_step_s": steps[0]["t"] if steps else None, "target": args.target,
              "reward_target_s": reached, "train_wall_s": round(wall, 1), "command_s": round(process_age_s(), 1)}
    (out / "trl.json").write_text(json.dumps(result, indent=2))
    print(f"TRL GRPOTrainer ({'bf16' if result['bf16'] else 'float32'}): {rate and round(rate, 2)} samples/s "
          f"after {args.warmup} steps, first step at {result['first_step_s']} s, batch reward >= {args.target} "
          f"at {reached} s, command {result['command_s']} s; wrote {out / 'trl.json'}")


if __name__ == "__main__":
    main()
