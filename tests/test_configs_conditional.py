"""Conditional keys (configs.validate.Conditional): a key set where it cannot act is refused naming the key and
its condition (the CLIs exit 2), or warned about (train.xla_overlap off TPU/GPU); where it acts it passes.
Also: the config names a mistyped --config offers are config files only."""
import argparse
import os
import subprocess
import sys

import pytest

import configs
import train  # noqa: F401  (registers the train and data packages' checks, as every command does)
from configs import loader
from configs import validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MOE = {"model.num_experts": 8}
_LLAMA3 = {"model.rope_scaling": "llama3"}
_GIVEN_TOKENIZER = {"data.tokenizer": "/tmp/tok.model"}
_CHAT = {"data.sources": "instruct=builtin:instruct"}
_DISTILL = {"train.objective": "distill"}
_BEST_OF_N = {"rl.algorithm": "best_of_n", "train.objective": "sft"}
_PPO = {"rl.algorithm": "ppo", "train.objective": "ppo"}
# key: (a value other than its default, overrides under which it cannot act, overrides under which it acts); on
# top of configs/tiny.py.
CASES = {
    "train.pipeline_microbatches": (4, {}, {"mesh.stage": 2}),
    "train.pipeline_repeats": (2, {}, {"mesh.stage": 2}),
    "train.pipeline_remat": (True, {}, {"mesh.stage": 2}),
    "train.moe_aux_loss": (0.1, {}, _MOE),
    "train.router_z_loss": (0.01, {}, _MOE),
    "train.loss_scale_init": (1024.0, {}, {"train.loss_scale": "dynamic"}),
    "train.loss_scale_period": (100, {}, {"model.dtype": "float16"}),
    "train.lora_alpha": (8.0, {}, {"train.lora_rank": 4}),
    "train.lora_targets": (("q", "v"), {}, {"train.lora_rank": 4}),
    "train.lora_rslora": (True, {}, {"train.lora_rank": 4}),
    "train.lora_dropout": (0.1, {}, {"train.lora_rank": 4}),
    "train.lora_base_quant": ("nf4", {}, {"train.lora_rank": 4}),
    "train.lora_base_double_quant": (True, {}, {"train.lora_rank": 4, "train.lora_base_quant": "nf4"}),
    "train.dpo_beta": (0.5, {}, {"train.objective": "dpo"}),
    "train.dpo_loss": ("ipo", {}, {"train.objective": "dpo"}),
    "train.dpo_label_smoothing": (0.1, {}, {"train.objective": "dpo"}),
    "train.dpo_rpo_alpha": (0.5, {}, {"train.objective": "dpo"}),
    "train.reward_center": (0.01, {}, {"train.objective": "reward"}),
    **{f"train.{k}": (v, {}, _DISTILL) for k, v in (
        ("distill_teacher", "runs/tiny"), ("distill_teacher_recipe", "tiny"), ("distill_loss", "reverse_kl"),
        ("distill_temperature", 2.0), ("distill_top_k", 20), ("distill_lm_weight", 0.5))},
    "train.distill_beta": (0.2, _DISTILL, {**_DISTILL, "train.distill_loss": "jsd"}),
    "train.mlm_rate": (0.3, {}, {"train.objective": "mlm", "model.causal": False}),
    "train.mlm_mask_fraction": (0.5, {}, {"train.objective": "mlm", "model.causal": False}),
    "train.mlm_random_fraction": (0.2, {}, {"train.objective": "mlm", "model.causal": False}),
    "train.eval_generations": (64, {}, _CHAT),
    "train.eval_tasks": ("mc:/tmp/mc.jsonl", {"train.eval_every": 0}, {}),
    "train.eval_tasks_limit": (10, {}, {"train.eval_tasks": "mc:/tmp/mc.jsonl"}),
    **{f"train.{k}": (v, {}, {"train.optimizer": "muon"}) for k, v in (
        ("muon_momentum", 0.9), ("muon_nesterov", False), ("muon_ns_steps", 6),
        ("muon_ns_coeffs", (2.0, -1.5, 0.5)), ("muon_rms", 0.3))},
    **{f"train.{k}": (v, {}, {"train.optimizer": "adafactor"}) for k, v in (
        ("adafactor_decay_rate", 0.5), ("adafactor_clip", 0.0), ("adafactor_momentum", 0.9),
        ("adafactor_min_dim_to_factor", 64))},
    "train.schedule_free_weight_lr_power": (1.0, {}, {"train.optimizer": "schedule_free_adamw",
                                                      "train.schedule": "constant"}),
    "train.b1": (0.8, {"train.optimizer": "adafactor"}, {"train.optimizer": "lion"}),
    "train.b2": (0.99, {"train.optimizer": "adafactor"}, {"train.optimizer": "lion"}),
    "train.eps": (1e-6, {"train.optimizer": "lion"}, {"train.optimizer": "muon"}),
    "train.decay_fraction": (0.5, {}, {"train.schedule": "wsd"}),
    "train.min_lr_ratio": (0.0, {"train.schedule": "constant"}, {}),
    "rl.kl_target": (6.0, {}, {"rl.algorithm": "ppo", "train.objective": "ppo"}),
    "rl.kl_horizon": (500, {"rl.algorithm": "ppo"}, {"rl.algorithm": "ppo", "rl.kl_target": 6.0}),
    **{f"rl.{k}": (v, {}, {"rl.algorithm": "ppo"}) for k, v in (
        ("gamma", 0.99), ("lam", 0.9), ("value_clip", 0.5), ("vf_coef", 0.5), ("ent_coef", 0.01),
        ("whiten_advantages", False))},
    "rl.clip": (0.1, _BEST_OF_N, {}),
    "rl.clip_high": (0.28, _BEST_OF_N, {}),
    "rl.mask_truncated": (True, _BEST_OF_N, {}),
    "rl.loss": ("gspo", _PPO, {}),
    "rl.scale_rewards": ("batch", _PPO, {}),
    "rl.dynamic_sampling": (True, _PPO, {}),
    "rl.dynamic_sampling_rounds": (2, {}, {"rl.dynamic_sampling": True}),
    "rl.overlong_buffer": (2, {"rl.algorithm": "gkd"}, {}),
    "rl.max_turns": (3, {}, {"rl.env": "builtin:calculator"}),
    "rl.reward": ("py:rl_testing:length", {"rl.env": "builtin:calculator"}, {}),
    "rl.max_staleness": (2, {}, {"rl.async_rollouts": True}),
    "rl.rollout_devices": (2, {}, {"rl.async_rollouts": True}),
    "rl.tis_cap": (2.0, {}, {"rl.async_rollouts": True}),
    "rl.length_penalty": (0.1, {"rl.algorithm": "gkd"}, {}),
    "rl.missing_eos_penalty": (0.5, {"rl.algorithm": "gkd"}, {}),
    "rl.kl_coef": (0.1, _BEST_OF_N, {}),
    "rl.ptx_coef": (1.0, {}, _CHAT),
    "rl.eval_prompts": (8, {"rl.eval_every": 0}, {}),
    "rl.eval_best_of": (4, {"rl.eval_every": 0}, {}),
    "log.wandb_project": ("other", {}, {"log.wandb": True}),
    **{f"data.{k}": (v, _GIVEN_TOKENIZER, {}) for k, v in (
        ("tokenizer_type", "unigram"), ("tokenizer_character_coverage", 1.0), ("tokenizer_byte_fallback", False),
        ("tokenizer_max_sentences", 1000))},
    "data.packing_bins": (4, {"data.packing": "concat"}, {}),
    "data.fim_spm_rate": (0.2, {}, {"data.fim_rate": 0.5}),
    "data.fim_level": ("token", {}, {"data.fim_rate": 0.5}),
    **{f"data.{k}": (v, {}, {"data.objective_mixture": "R:0.5,X:0.5"}) for k, v in (
        ("ul2_r_mean_span", 4.0), ("ul2_r_rate", 0.2), ("ul2_x_mean_span", 16.0), ("ul2_x_rate", 0.3))},
    "data.chat_loss": ("all", {}, _CHAT),
    "data.chat_truncation": ("left", {}, _CHAT),
    "data.text_field": ("body", {}, {"data.sources": "jsonl:/tmp/x.jsonl"}),
    "model.experts_per_token": (3, {}, _MOE),
    "model.moe_every": (2, {}, _MOE),
    "model.num_shared_experts": (1, {}, _MOE),
    "model.expert_mlp_dim": (96, {}, _MOE),
    "model.capacity_factor": (1.0, {}, _MOE),
    "model.router": ("softmax_topk", {}, _MOE),
    "model.moe_impl": ("tiled", {}, _MOE),
    "model.routed_scaling_factor": (2.5, {}, _MOE),
    "train.router_bias_update_rate": (0.001, _MOE, {**_MOE, "model.router": "sigmoid"}),
    "train.mtp_loss_weight": (0.1, {}, {"model.mtp_depth": 1}),
    "model.mtp_depth": (1, {"train.objective": "sft", **_CHAT}, {}),
    "model.router_groups": (2, {}, _MOE),
    "model.router_topk_groups": (2, {}, {**_MOE, "model.router_groups": 4}),
    "model.first_dense_layers": (1, {}, _MOE),
    "model.router_norm_topk": (False, _MOE, {**_MOE, "model.router": "sigmoid"}),
    **{f"model.{k}": (v, {}, {"model.attention_type": "mla"}) for k, v in (
        ("q_lora_rank", 16), ("kv_lora_rank", 64), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8),
        ("v_head_dim", 16), ("rope_interleave", True))},
    "model.rope_mscale_all_dim": (1.0, {}, {"model.rope_scaling": "yarn"}),
    "model.rope_scaling_factor": (4.0, {}, _LLAMA3),
    "model.rope_low_freq_factor": (2.0, {}, _LLAMA3),
    "model.rope_high_freq_factor": (8.0, {}, _LLAMA3),
    "model.rope_original_max_len": (4096, {}, _LLAMA3),
    **{f"model.{k}": (v, {}, {"model.rope_scaling": "yarn"}) for k, v in (
        ("rope_yarn_beta_fast", 16.0), ("rope_yarn_beta_slow", 2.0), ("rope_attention_factor", 1.2),
        ("rope_yarn_truncate", False))},
    "model.rope_local_theta": (10000.0, {}, {"model.sliding_window": 16}),
    "model.mup_base_width": (64, {}, {"model.parametrization": "mup"}),
    "model.attention_block_size": (64, {}, {"model.attention_impl": "blockwise"}),
    "model.context_layout": ("contiguous", {"model.context_parallel": "ulysses", "mesh.sequence": 2},
                             {"model.context_parallel": "ring", "mesh.sequence": 2}),
    "model.context_parallel": ("ring", {}, {"mesh.sequence": 2}),
    "train.context_extension": (True, {}, {"train.base_recipe": "tiny"}),
    "model.attention_query_block": (64, {"model.attention_impl": "dot_product"}, {}),
    "model.global_every": (2, {}, {"model.sliding_window": 16}),
    "model.quant_layers": (("mlp",), {}, {"model.quant": "int8"}),
    "model.scan_unroll": (2, {"model.scan_layers": False}, {}),
    # (idle: an explicit xla; under the default, auto, the platform decides: the Trainer warns, test_attention_auto)
    **{f"model.{k}": (v, {"model.attention_impl": "xla"}, {"model.attention_impl": "splash"}) for k, v in (
        ("splash_block_q", 256), ("splash_block_kv", 1024), ("splash_block_kv_compute", 256),
        ("splash_block_q_bwd", 256), ("splash_block_kv_bwd", 256))},
    "model.pallas_interpret": (True, {"model.attention_impl": "xla"}, {"model.attention_impl": "splash"}),
    **{f"model.{k}": (256, {**_MOE, "model.moe_impl": "ragged"}, {**_MOE, "model.moe_impl": "megablox"})
       for k in ("megablox_tile_m", "megablox_tile_k", "megablox_tile_n")},
}
WARNINGS = {"train.xla_overlap"}  # warned about where the platform is known (the Trainer's mesh)


def _load(**overrides):
  return configs.load("tiny", **overrides)


def test_every_conditional_key_has_a_case():
  assert sorted(CASES) == sorted({row.key for row in validate.conditional_rows()} - WARNINGS)
  assert {row.key for row in validate.conditional_rows() if row.severity == "warn"} == WARNINGS


@pytest.mark.parametrize("key", sorted(CASES))
def test_a_key_set_where_it_cannot_act_is_refused_naming_it(key):
  value, idle, acting = CASES[key]
  row = next(r for r in validate.conditional_rows() if r.key == key)
  with pytest.raises(configs.ConfigError) as e:
    validate.check(_load(**idle, **{key: value}))
  assert f"{key}={value!r} has no effect unless {row.condition}" in str(e.value)
  assert validate.check(_load(**idle)) == []  # at its default it is no error
  assert validate.check(_load(**acting, **{key: value})) == []


def test_facts_known_later_are_checked_then():
  """mesh.stage=-1 is resolved with the mesh; train.rl's own keys are told apart from `python -m train`'s."""
  staged = _load(**{"mesh.stage": -1, "train.pipeline_remat": True})
  assert validate.check(staged) == []
  with pytest.raises(configs.ConfigError, match=r"train.pipeline_remat=True has no effect unless mesh.stage > 1 "
                                                r"\(here stage=1\)"):
    validate.check_conditional(staged, stage=1, platform="cpu")
  assert validate.check_conditional(staged, stage=2, platform="cpu") == []
  chat = _load(**_CHAT, **{"train.eval_generations": 8})
  assert validate.check_conditional(chat, stage=1, platform="cpu") == []  # rows without those facts skipped
  assert validate.check_conditional(chat, command="rl") == []  # train.rl evaluates every rl.eval_every iterations
  idle = _load(**_CHAT, **{"train.eval_generations": 8, "rl.eval_every": 0})
  assert validate.check_conditional(idle, stage=1, platform="cpu") == []  # python -m train evaluates
  with pytest.raises(configs.ConfigError, match="train.eval_generations=8 has no effect unless"):
    validate.check_conditional(idle, command="rl")


def test_xla_overlap_off_tpu_and_gpu_is_a_warning_naming_the_key():
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  from train import config_checks  # pylint: disable=g-import-not-at-top
  assert set(config_checks.OVERLAP_PLATFORMS) == set(step_lib.OVERLAP_OPTIONS)
  config = _load(**{"train.xla_overlap": True})
  assert validate.check(config) == []  # no platform yet
  warnings = validate.check_conditional(config, platform="cpu", stage=1)
  assert len(warnings) == 1 and warnings[0].startswith("train.xla_overlap=True has no effect unless the devices "
                                                       "are TPUs or GPUs (here platform=cpu)")
  assert validate.check_conditional(config, platform="tpu", stage=1) == []


def test_the_trainer_warns_about_xla_overlap_on_cpu(capsys):
  import jax  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  config = _load(**{"train.xla_overlap": True, "mesh.data": 1})
  step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices("cpu")[:1]))
  assert "warning: train.xla_overlap=True has no effect unless the devices are TPUs or GPUs (here platform=cpu)" \
      in capsys.readouterr().err


def test_the_trainer_refuses_pipeline_keys_without_stages():
  import jax  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  config = _load(**{"mesh.data": 1, "train.pipeline_microbatches": 1})
  with pytest.raises(ValueError, match=r"train.pipeline_microbatches=1 has no effect unless mesh.stage > 1"):
    step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices("cpu")[:1]))


def test_train_rl_answers_held_out_chat_prompts_only_when_it_evaluates():
  """grpo_tiny (chat data in data.sources): train.rl answers train.eval_generations held-out prompts at each of its
  evaluations, so the key acts with rl.eval_every > 0 and is refused with rl.eval_every=0; train.eval_tasks never
  acts there (train.rl runs no benchmark tasks)."""
  from train.core import loop  # pylint: disable=g-import-not-at-top
  from train.rl import loop as rl_loop  # pylint: disable=g-import-not-at-top
  rl_loop._check_rl(configs.load("grpo_tiny", **{"train.eval_generations": 8}))  # pylint: disable=protected-access
  config = configs.load("grpo_tiny", **{"rl.eval_every": 0, "train.eval_every": 10, "train.eval_generations": 8})
  assert validate.check(config) == []
  with pytest.raises(loop.SetupError, match="train.eval_generations=8 has no effect unless"):
    rl_loop._check_rl(config)  # pylint: disable=protected-access
  with pytest.raises(loop.SetupError, match="train.eval_tasks=.* has no effect unless"):
    tasks = configs.load("grpo_tiny", **{"train.eval_tasks": "mc:/tmp/mc.jsonl"})
    rl_loop._check_rl(tasks)  # pylint: disable=protected-access


def test_a_key_only_the_config_file_set_is_a_warning_when_another_override_idles_it():
  """A config file's rl.eval_prompts=4 made inert by --config.rl.eval_every=0 (the user's choice): a warning
  naming it; given on the command line too, it is refused."""
  # as if the file set 4 (its train.eval_generations would idle with rl.eval_every=0 too: left out here)
  config = configs.load("grpo_tiny", **{"rl.eval_prompts": 4, "rl.eval_every": 0, "train.eval_generations": 0})
  warnings = validate.check(config, explicit=["rl.eval_every"])
  assert any(w.startswith("rl.eval_prompts=4 has no effect unless rl.eval_every > 0") for w in warnings), warnings
  with pytest.raises(configs.ConfigError, match="rl.eval_prompts=4 has no effect"):
    validate.check(config, explicit=["rl.eval_every", "rl.eval_prompts"])
  with pytest.raises(configs.ConfigError, match="rl.eval_prompts=4 has no effect"):
    validate.check(config)  # explicit unknown: every key counts as given
  _, args = configs.parse(["--config=grpo_tiny", "--config.rl.eval_every=0"], argparse.ArgumentParser())
  assert args.overrides == ["rl.eval_every"]


def test_every_config_file_passes():
  for name in loader.config_names():
    assert validate.check(configs.load(name)) == [], name
  for name in ("grpo_tiny", "ppo_tiny", "best_of_n_tiny"):
    assert validate.check_conditional(configs.load(name), command="rl") == [], name


def _cli(module, *args):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module,args,needle", [
    ("train", ["--config.train.eval_generations=64"], "train.eval_generations=64 has no effect"),
    ("train", ["--config.train.pipeline_remat=true"], "train.pipeline_remat=True has no effect unless mesh.stage > 1"),
    ("train.rl", ["--config=grpo_tiny", "--config.rl.kl_target=6.0"],
     "rl.kl_target=6.0 has no effect unless rl.algorithm=ppo"),
])
def test_the_clis_exit_2_naming_the_key(tmp_path, module, args, needle):
  proc = _cli(module, f"--workdir={tmp_path / 'run'}", *args)
  assert proc.returncode == 2, proc.stderr
  assert needle in proc.stderr and "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()


def test_a_mistyped_config_lists_config_files_only():
  names = loader.config_names()
  assert "tiny" in names and "base" in names and "curate" in names
  assert not {"loader", "validate", "errors", "_maxtext", "__init__"} & set(names)
  with pytest.raises(configs.ConfigError) as e:
    configs.parse(["--config=tinyy"], argparse.ArgumentParser())
  assert str(e.value).split("one of: ")[1].split(", ") == names
  proc = _cli("train", "--config=tinyy")
  assert proc.returncode == 2
  listed = proc.stderr.strip().split("one of: ")[1].split(", ")
  assert listed == names and "loader" not in listed and "validate" not in listed
