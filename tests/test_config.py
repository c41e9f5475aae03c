import json
from pathlib import Path

import pytest
import yaml

from async_rlhf.config import Config, ConfigError, load_config, parse_override
from async_rlhf.launch.cli import COMMANDS, main


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.generator.schedule == "stream" and cfg.generator.weight_updates == "inflight"


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_staleness: 1\nlearner:\n  lr: 3.0e-4\n  zero_stage: 2\n")
    cfg = load_config(path, ["learner.lr=1e-5", "generator.engine=hf", "queue.redis_url=redis://h:1",
                             'generator.stop=["\\n\\n", "User:"]'])
    assert cfg.max_staleness == 1
    assert cfg.generator.stop == ("\n\n", "User:")
    assert cfg.learner.lr == 1e-5 and cfg.learner.zero_stage == 2
    assert cfg.generator.engine == "hf"
    assert cfg.queue.redis_url == "redis://h:1"
    # every choice of learner.mixed_precision survives YAML as a string (YAML reads `off` as false)
    for choice in ("auto", "bf16", "fp32"):
        assert load_config(None, [f"learner.mixed_precision={choice}"]).learner.mixed_precision == choice


def test_generator_resources_is_a_mapping_of_numbers():
    cfg = load_config(overrides=["generator.resources={node_b: 1}"])
    assert cfg.generator.resources == {"node_b": 1.0}
    assert load_config().generator.resources == {}


def test_ints_accepted_for_floats():
    assert load_config(overrides=["learner.lr=1"]).learner.lr == 1.0


def test_rewards_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "rewards:\n"
        "  - {kind: function, target: 'actors.tasks:score', weight: 0.5}\n"
        "  - {kind: http, target: 'http://127.0.0.1:9/score', timeout_s: 2}\n"
    )
    cfg = load_config(path)
    assert [r.kind for r in cfg.rewards] == ["function", "http"]
    assert cfg.rewards[1].timeout_s == 2.0
    path.write_text("rewards:\n  - {target: 'actors.tasks:score'}\n  - {kind: bogus, target: x}\n")
    with pytest.raises(ConfigError, match=r"^rewards\[1\]\.kind must be one of"):
        load_config(path)
    path.write_text("rewards:\n  - {target: 'actors.tasks:score', retries: -1}\n")
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.retries must be >= 0"):
        load_config(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("max_staleness=-1", "max_staleness must be >= 0, got -1"),
        ("learner.zero_stage=4", "learner.zero_stage must be one of 0, 1, 2, 3, got 4"),
        ("generator.engine=sglang", "generator.engine must be one of 'vllm', 'hf', got 'sglang'"),
        ("learner.lr=fast", "learner.lr must be a number, got 'fast'"),
        ("learner.steps=2.5", "learner.steps must be an integer, got 2.5"),
        ("learner.step_timeout_s=30", "learner.step_timeout_s must be above learner.wait_s=60 (a step's wait "
                                      "for data counts towards it), got 30"),
        ("generator.top_p=0.9", "generator.top_p must be 1.0 for training"),
        ("learner.micro_batch=5", "learner.batch_size must be divisible by learner.micro_batch (5)"),
        ("learner.lerning_rate=1", "unknown config key learner.'lerning_rate'"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("data.source=jsonl", "data.path must be set when data.source=jsonl"),
        ("generator.group_size=3", "learner.batch_size must be a multiple of generator.group_size (3)"),
        ("generator.max_inflight=2", "generator.max_inflight must be >= generator.group_size (8)"),
        ("generator.schedule=batch", "generator.schedule must be one of 'stream', 'lockstep'"),
        ("generator.weight_updates=never", "generator.weight_updates must be one of 'inflight'"),
        ('generator.stop="###"', "generator.stop must be a list, got '###'"),
        ('generator.stop=["###", ""]', "generator.stop must be a list of non-empty strings"),
        ("generator.stop=[3]", "generator.stop[0] must be of type str, got 3"),
        ("generator.prompts_per_batch=8", "generator.prompts_per_batch is retired: generators stream"),
        ("learner=3", "learner. must be a mapping, got 3"),
        ("generator.dtype=fp8", "generator.dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
        ("generator.gpu_memory_utilization=1.5", "generator.gpu_memory_utilization must be auto or a fraction"),
        ("generator.enforce_eager=maybe", "generator.enforce_eager must be of type bool, got 'maybe'"),
        ("generator.resources=[1]", "generator.resources must be a mapping, got [1]"),
        ("generator.resources={node_b: 0}", "generator.resources['node_b'] must be > 0, got 0.0"),
        ("generator.resources={GPU: 1}", "generator.resources must be custom resources only: CPUs come"),
        ("learner.overlong=soft", "learner.overlong_buffer must be in 1..255 with learner.overlong=soft"),
        ("learner.overlong=cut", "learner.overlong must be one of 'none', 'mask', 'soft'"),
        ("learner.reward_clip=-1", "learner.reward_clip must be >= 0 (0: no clipping), got -1.0"),
        ("env.max_turns=0", "env.max_turns must be > 0, got 0"),
        ("generator.max_draws_per_group=0", "generator.max_draws_per_group must be >= 1 (groups drawn per group "
                                            "put; 1: dynamic sampling drops nothing), got 0"),
        ("env.target=myenv", "env.target must be module:Class, e.g. actors.envs:GuessNumber"),
        ("env.args=[1]", "env.args must be a mapping, got [1]"),
        ("learner.lr_warmup_steps=-1", "learner.lr_warmup_steps must be in 0..learner.steps (50): a warmup "
                                       "cannot outlast the run, got -1"),
        ("learner.lr_warmup_steps=51", "learner.lr_warmup_steps must be in 0..learner.steps (50)"),
        ("learner.lr_schedule=exponential", "learner.lr_schedule must be one of 'constant', 'linear', 'cosine'"),
        ("learner.clip_eps_high=0", "learner.clip_eps_high must be > 0 (or unset: the upper bound is "
                                    "1 + learner.clip_eps), got 0.0"),
        ("learner.keep_checkpoints=0", "learner.keep_checkpoints must be > 0, got 0"),
    ],
)
def test_bad_values_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_reward_shaping_is_ppos_and_episodes_need_vllm_and_ppo():
    with pytest.raises(ConfigError, match=r"reward shaping must be off with learner.algorithm=dpo.*'overlong': 'mask'"):
        load_config(overrides=["learner.algorithm=dpo", "learner.overlong=mask"])
    with pytest.raises(ConfigError, match="learner.algorithm must be ppo with env.target="):
        load_config(overrides=["env.target=actors.envs:GuessNumber", "learner.algorithm=rs"])
    soft = load_config(overrides=["env.target=actors.envs:GuessNumber", "env.max_tokens=40",
                                  "learner.overlong=soft", "learner.overlong_buffer=30"])
    assert soft.response_limit == 40  # an episode's limit is its token budget


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_override("learner.lr")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
    assert configs, "configs/ holds no YAML file"
    for path in configs:
        load_config(path)


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_cli_overrides_may_come_between_flags():
    from async_rlhf.launch.cli import config_from_args, parse

    args, _ = parse(["train", "learner.steps=3", "--max-staleness", "1", "placement=manual", "generator.count=2"])
    cfg = config_from_args(args)
    assert (cfg.learner.steps, cfg.max_staleness, cfg.generator.count) == (3, 1, 2)
    with pytest.raises(SystemExit):
        parse(["train", "--bogus-flag"])
    with pytest.raises(SystemExit):
        parse(["status", "--job", "x", "learner.steps=3"])  # status takes no overrides


def test_redact_url_hides_user_and_password():
    from async_rlhf.config import redact_url

    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://***@127.0.0.1:6379/0"
    assert redact_url("redis://user:p@ss@host:1/0") == "redis://***@host:1/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_config_command_shows_the_resolved_config_and_its_schema(capsys):
    assert main(["config", "--config", "configs/demo.yaml", "learner.lr=3e-4",
                 "queue.redis_url=redis://:s3cret@127.0.0.1:6379/0"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["learner"]["lr"] == 3e-4 and shown["job"] == "demo"
    assert shown["queue"]["redis_url"] == "redis://***@127.0.0.1:6379/0"
    assert main(["config", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    generator = schema["$defs"]["GeneratorConfig"]["properties"]
    assert generator["schedule"]["enum"] == ["stream", "lockstep"]


def test_a_bad_value_ends_the_command_with_the_key_and_no_traceback(capsys):
    assert main(["train", "learner.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "config error: learner.lr must be > 0, got -1.0" in err and "Traceback" not in err


def test_config_reference_is_docs_config_md_and_gives_every_key_a_meaning(capsys):
    """docs/config.md is what `async-rlhf config --reference` prints: a changed default, a new
    key or a changed comment fails here until the file is regenerated."""
    assert main(["config", "--reference"]) == 0
    printed = capsys.readouterr().out
    committed = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert printed == committed, "docs/config.md is stale: run `async-rlhf config --reference > docs/config.md`"
    keys = [row.split("|")[1].strip() for row in printed.splitlines() if row.startswith("| `")]
    assert len(keys) > 60 and "`rewards[i].timeout_s`" in keys and "`eval.samples`" in keys
    missing = [row.split("|")[1].strip() for row in printed.splitlines() if row.startswith("| `") and row.endswith("|  |")]
    assert not missing, f"keys without a comment beside their field in config.py: {missing}"
    assert "| `learner.lr` | float | `1e-06` |  | the policy's learning rate (AdamW): TRL's GRPO default" in printed
    assert "| `generator.schedule` | choice | `'stream'` | `stream`, `lockstep` |" in printed


def test_help_imports_no_command_module():
    """`async-rlhf --help` stays light: no torch, Ray, vLLM or DeepSpeed import."""
    import subprocess
    import sys

    code = ("import sys\nfrom async_rlhf.launch.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print([m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_launchers_own_process_imports_no_torch(tmp_path):
    """What `train` runs in its own process (the launcher, the roles it asks Ray for, its metrics
    with TensorBoard, the checkpoint it resumes from, the weight-sync address the learner hands it
    to pass on) imports no torch: ~1.5 CPU-s taken from the engines while they start, and the
    first learner step waits on it."""
    import pickle
    import subprocess
    import sys

    from async_rlhf import weight_sync

    # pickled as the learner's open_epoch returns it
    address = pickle.dumps(weight_sync.SyncAddress("127.0.0.1", 1, epoch=1, world_size=2, backend="gloo",
                                                   key="k"))
    code = ("import pickle, sys\nfrom pathlib import Path\nfrom async_rlhf.launch import launcher, roles\n"
            "from async_rlhf.launch.metrics import MetricsLog\nfrom learners.checkpoints import checkpoint_version\n"
            f"MetricsLog(Path({str(tmp_path)!r}), 1).close()\ncheckpoint_version({str(tmp_path)!r})\n"
            f"pickle.loads(bytes.fromhex({address.hex()!r}))\n"
            "print([m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.algorithm=dpo", "generator.group_size=1", "learner.batch_size=8"],
         "generator.group_size must be >= 2 with learner.algorithm=dpo (a pair is two responses of one group), got 1"),
        (["learner.algorithm=dpo", "generator.group_size=4", "learner.micro_batch=2"],
         "learner.micro_batch must be a multiple of generator.group_size (4) with learner.algorithm=dpo"),
        (["learner.algorithm=rs", "learner.advantage=gae"],
         "learner.advantage must be grpo, rloo or reinforce_pp with learner.algorithm=rs"),
        (["learner.algorithm=dpo", "learner.kl_coef=0.1"],
         "learner.kl_coef must be 0 with learner.algorithm=dpo (dpo has its KL strength in learner.dpo_beta"),
        (["learner.algorithm=dpo", "learner.dpo_beta=0"], "learner.dpo_beta must be > 0, got 0"),
        (["learner.algorithm=sft"], "learner.algorithm must be one of 'ppo', 'dpo', 'rs', got 'sft'"),
        (["data.source=preferences", "data.path=p.jsonl"],
         "learner.algorithm must be dpo with data.source=preferences (the file holds pairs"),
        (["data.source=preferences", "data.path=p.jsonl", "learner.algorithm=dpo"],
         "generator.group_size must be 2 with data.source=preferences (a group is one pair), got 8"),
        (["data.source=preferences", "data.path=p.jsonl", "learner.algorithm=dpo", "generator.group_size=2",
          "placement=manual", "generator.count=2"], "generator.count must be 1 with data.source=preferences"),
        (["data.source=preferences", "data.path=p.jsonl", "learner.algorithm=dpo", "generator.group_size=2"],
         "placement must be manual with data.source=preferences"),
    ],
)
def test_preference_algorithms_need_groups_and_no_critic_or_kl(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value)
    load_config(overrides=["learner.algorithm=rs", "generator.group_size=1", "learner.batch_size=8"])
