"""verl keys: each accepted key has its effect or is refused with what to set instead."""

import re

import pytest

from sfttrain.config import ConfigError, load_config, mixed_precision_dtypes

COMMON = ["data.train_files=x.parquet", "model.partial_pretrain=m"]


@pytest.mark.parametrize("override, message", [
    ("data.balance_dp_token=false", "data.balance_dp_token=false: sfttrain always spreads"),
    ("model.strategy=fsdp", "model.strategy='fsdp': sfttrain implements FSDP2"),
    ("model.fsdp_config.mixed_precision.buffer_dtype=bf16", "buffer_dtype='bf16'.*set it to fp32"),
    ("model.fsdp_config.model_dtype=fp16", "fp16 .*needs loss scaling.*use bf16"),
    ("model.fsdp_config.mixed_precision.param_dtype=fp16", "fp16 .*needs loss scaling"),
    ("trainer.logger=[console,tensorboard]",
     r"logger='tensorboard' is not one of .*metrics.jsonl .*sfttrain.plot.* wandb"),
])
def test_silently_ignored_verl_values_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, override])


@pytest.mark.parametrize("override", ["data.balance_dp_token=true", "model.strategy=fsdp2",
                                      "model.fsdp_config.mixed_precision.buffer_dtype=fp32"])
def test_values_that_name_what_sfttrain_does_load_as_its_defaults(override):
    """verl's values for sfttrain's only behaviour (balanced tokens, FSDP2, fp32 buffers) load, to the run
    that leaving them out gives (the mixed precision spelled as a dict: the same dtypes)."""
    config, default = (load_config(overrides=[*COMMON, *extra]) for extra in ([override], []))
    mixed = config.model.fsdp_config, default.model.fsdp_config
    assert mixed_precision_dtypes(mixed[0]) == mixed_precision_dtypes(mixed[1])
    mixed[0].mixed_precision = mixed[1].mixed_precision
    assert config == default


@pytest.mark.parametrize("override", ["trainer.log_freq=0", "trainer.log_freq=-2", "trainer.total_training_steps=0",
                                      "trainer.total_training_steps=-1", "data.num_workers=-1", "trainer.seed=-1"])
def test_counts_that_crash_or_mean_nothing_are_refused_with_a_valid_value(override):
    """log_freq=0 divided by zero after the first step, total_training_steps <= 0 trained nothing (0: the
    epochs, silently), num_workers < 0 ended in the DataLoader's ValueError, a negative seed in numpy's once
    the rows were read (preflight and run, a traceback): each is refused naming the
    key and a value, which loads. (save_freq and test_freq <= 0, -1 in verl's configs, mean "at the end
    only"; max_ckpt_to_keep 0, as null, keeps all: accepted.)"""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(override)}\b") as refused:
        load_config(overrides=[*COMMON, override])
    valid = re.search(rf"e\.g\. ({re.escape(key)}=\d+)|, or (null) ", str(refused.value))
    load_config(overrides=[*COMMON, valid.group(1) or f"{key}={valid.group(2)}"])
    for kept in ("trainer.save_freq=0", "trainer.test_freq=0", "trainer.max_ckpt_to_keep=0"):
        load_config(overrides=[*COMMON, kept])


def test_verls_dynamic_batch_switch_agrees_with_the_token_budget():
    """data.use_dynamic_bsz (verl's new SFT trainer) was an unknown key ("did you mean
    data.response_dict_keys?"). Each value loads where the budget agrees with it; where it does not,
    the refusal names a setting that loads."""
    for agreeing in (["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=4096"], ["data.use_dynamic_bsz=false"]):
        load_config(overrides=[*COMMON, *agreeing])
    assert load_config(overrides=[*COMMON, *agreeing]).data.max_token_len_per_gpu is None
    with pytest.raises(ConfigError, match=r"data.use_dynamic_bsz=true .* e\.g\. data.max_token_len_per_gpu=8192$"):
        load_config(overrides=[*COMMON, "data.use_dynamic_bsz=true"])
    load_config(overrides=[*COMMON, "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=8192"])
    with pytest.raises(ConfigError, match=r"data.use_dynamic_bsz=false runs micro-batches of data.micro_batch_size_per"
                                          r"_gpu=4 samples, but data.max_token_len_per_gpu=8192 "
                                          r".*remove data.max_token"):
        load_config(overrides=[*COMMON, "data.use_dynamic_bsz=false", "data.max_token_len_per_gpu=8192"])


@pytest.mark.parametrize("overrides, message", [
    (["model.fsdp_config.fsdp_size=2"], "NO_SHARD .* contradicts fsdp_size=2; .*HYBRID_SHARD"),
    (["model.fsdp_config.cpu_offload=true"], "NO_SHARD .*CPU offload moves FSDP's shards.*FULL_SHARD"),
    (["ulysses_sequence_parallel_size=2"], "NO_SHARD .*Ulysses ranks share one copy.*FULL_SHARD"),
])
def test_no_shard_refuses_what_needs_shards(overrides, message):
    """NO_SHARD is DDP: a shard size, offloaded shards or Ulysses' FSDP group cannot hold."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, "model.fsdp_config.sharding_strategy=NO_SHARD", *overrides])


def test_verls_sft_trainer_yaml_keys_that_say_none(capsys):
    """The keys of verl's own sft_trainer.yaml that name what sfttrain does not have load where they
    say none (their values there), each said once; a value is refused with why and what to do."""
    cfg = load_config(overrides=[*COMMON, "data.custom_cls.path=null", "data.custom_cls.name=null",
                                 "data.image_key=null", "model.external_lib=null", "trainer.resume_path=null",
                                 "data.processor.use_fast=true"])
    assert cfg.trainer.resume_from_path is None
    out = capsys.readouterr().out
    for key in ("data.custom_cls={path: null, name: null}", "data.image_key=null", "model.external_lib=null",
                "trainer.resume_path=null"):  # as typed: YAML's null, not Python's None
        assert f"sfttrain: ignoring {key} (verl's key, none given): " in out, out
    assert "sfttrain: ignoring data.processor={use_fast: true}: verl's processor settings for image data" in out, out
    for override, message in [("model.external_lib=my_models", "model.external_lib='my_models': verl imports that "
                                                               "module to register a custom model"),
                              ("trainer.resume_path=ckpt/global_step_5", "trainer.resume_path='ckpt/global_step_5': "
                                                                         ".*use trainer.resume_mode=resume_path"),
                              ("data.custom_cls.path=my_dataset.py", "data.custom_cls=.*convert the data")]:
        with pytest.raises(ConfigError, match=rf"^{message}.*; remove the key \(or set it to null\)$"):
            load_config(overrides=[*COMMON, override])
    # a verl key refused, or a value of the wrong type, is listed with every other problem of the config
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[*COMMON, "model.external_lib=my_models", "trainer.save_interval=3",
                               "trainer.save_freq=4", "trainer.checkpoint.keep=2", "optim.learning_rate=1",
                               "data.max_length=long", "optim.lr=-1"])
    assert [line.split(":")[0] for line in str(refused.value).splitlines()] == [
        "both trainer.save_interval and trainer.save_freq are set; trainer.save_interval is verl's name for "
        "trainer.save_freq", "trainer.checkpoint.keep", "model.external_lib='my_models'",
        "unknown config key 'optim.learning_rate'; did you mean optim.lr?", "bad value for data.max_length",
        "optim.lr=-1.0 is negative; peak "
        "learning rate, reached after the warmup"], str(refused.value)


def test_verls_checkpoint_contents(tmp_path, capsys):
    """verl's trainer.checkpoint section (its sft_trainer.yaml's, load_contents an interpolation of
    save_contents) loads, said once; hf_model on the command line is trainer.save_hf=true; an unknown
    content or key is refused naming verl's."""
    yaml = tmp_path / "verl.yaml"
    yaml.write_text("trainer:\n  checkpoint:\n    save_contents: [model, optimizer, extra]\n"
                    "    load_contents: ${trainer.checkpoint.save_contents}\n")
    assert load_config(str(yaml), COMMON).trainer.save_hf is False
    assert "sfttrain: ignoring trainer.checkpoint (save_contents=['model', 'optimizer', 'extra'], load_contents=" \
           "${trainer.checkpoint.save_contents}): sfttrain's checkpoints always hold" in capsys.readouterr().out
    cfg = load_config(str(yaml), [*COMMON, "trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    assert cfg.trainer.save_hf is True and "hf_model is trainer.save_hf=true" in capsys.readouterr().out
    for override, message in [("+trainer.checkpoint.save_contents=[model,hf]",
                               r"\['hf'\] unknown; verl's contents are"),
                              ("trainer.checkpoint.keep=2", "trainer.checkpoint.keep: unknown key")]:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=[*COMMON, override])


def test_verls_ppo_keys_are_named_as_such(tmp_path):
    """A seed article's GRPO template (actor_rollout_ref.*, trainer.critic_warmup beside data.train_batch_size)
    pasted into an SFT run: each PPO key is said to be one, once per section, with SFT's batch keys,
    not a suggestion of the closest SFT key (trainer.nccl_timeout)."""
    yaml = tmp_path / "grpo.yaml"
    yaml.write_text("data:\n  train_batch_size: 60\ntrainer:\n  critic_warmup: 0\nactor_rollout_ref:\n  actor:\n"
                    "    ppo_mini_batch_size: 60\n    fsdp_config:\n      fsdp_size: -1\n  rollout:\n    n: 12\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(yaml), COMMON)
    lines = str(e.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["trainer.critic_warmup", "actor_rollout_ref"], lines
    assert all("a key of verl's PPO/GRPO trainer (ppo_trainer.yaml), not of its SFT trainer" in line and
               "data.micro_batch_size_per_gpu" in line and "did you mean" not in line for line in lines), lines


def test_hydra_append_syntax_and_ignored_verl_keys(capsys):
    """`+key=value` sets a key sfttrain knows; verl keys without meaning here are dropped with one
    line each saying why; a key that is neither stays an error, with or without the +."""
    cfg = load_config(overrides=[*COMMON, "+data.response_dict_keys=[answer]", "++optim.lr=2e-5",
                                 "trainer.default_hdfs_dir=null", "data.micro_batch_size=8"])
    assert cfg.data.response_dict_keys == ["answer"] and cfg.optim.lr == 2e-5
    out = capsys.readouterr().out
    assert "ignoring trainer.default_hdfs_dir=null: verl copies each checkpoint to HDFS" in out
    assert "ignoring data.micro_batch_size=8" in out
    for key in ("+data.promt_key=x", "trainer.default_hdfs_dirs=x"):
        with pytest.raises(ConfigError, match="unknown config key"):
            load_config(overrides=[*COMMON, key])


@pytest.mark.parametrize("text", [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # YAML cannot scan it
    "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",  # YAML would read a mapping
    "<|im_start|>{{ messages[0].content }}\n<|im_end|> # not a comment",  # YAML would fold the line, drop the '#'
])
def test_string_values_on_the_command_line_are_the_text(text):
    assert load_config(overrides=[*COMMON, f"data.chat_template={text}"]).data.chat_template == text


def test_values_are_still_yaml_where_yaml_reads_them():
    cfg = load_config(overrides=[*COMMON, "data.prompt_key='a b'", "data.val_files=null", "optim.betas=[0.8,0.9]",
                                 "trainer.logger=[console,wandb]"])
    assert (cfg.data.prompt_key, cfg.data.val_files, cfg.optim.betas) == ("a b", None, [0.8, 0.9])
    assert cfg.trainer.logger == ["console", "wandb"]
    one = load_config(overrides=[*COMMON, "data.prompt_dict_keys=question", "data.response_dict_keys=[answer]"])
    # a word: a list of one
    assert (one.data.prompt_dict_keys, one.data.response_dict_keys) == (["question"], ["answer"])


def test_hydra_config_path_and_name_name_the_yaml_file(tmp_path):
    """verl's `--config-path DIR --config-name NAME` (Hydra's; also -cp/-cn and =) reads DIR/NAME.yaml,
    the overrides after it as ever; naming a file both ways, or a path without a name, is refused."""
    from sfttrain.run import parse_args

    (tmp_path / "my_sft.yaml").write_text("data:\n  train_files: x.parquet\n  max_length: 77\n"
                                          "model:\n  partial_pretrain: m\n")
    for argv in (["--config-path", str(tmp_path), "--config-name", "my_sft", "optim.lr=2e-5"],
                 [f"--config-path={tmp_path}", "--config-name=my_sft.yaml", "optim.lr=2e-5"],
                 ["optim.lr=2e-5", "-cn", "my_sft", "-cp", str(tmp_path)]):
        cfg = load_config(*parse_args(argv))
        assert (cfg.data.max_length, cfg.optim.lr) == (77, 2e-5), argv
    for argv in ([str(tmp_path / "my_sft.yaml"), "--config-name=my_sft"], [f"--config-path={tmp_path}"]):
        with pytest.raises(ConfigError, match="name the YAML file once: as the first argument .* --config-name NAME"):
            parse_args(argv)
    (tmp_path / "composed.yaml").write_text("defaults:\n  - optim: adamw\n" + (tmp_path / "my_sft.yaml").read_text())
    with pytest.raises(ConfigError, match="defaults: Hydra's list of other config files to compose is not read here"):
        load_config(*parse_args(["-cp", str(tmp_path), "-cn", "composed"]))


def test_a_resume_path_with_resume_mode_disable_is_refused(capsys):
    """verl drops trainer.resume_from_path under resume_mode=disable without a word: which was meant? The run
    stops (exit code 2) naming both keys and each way out, and the preflight lists the same problem."""
    from sfttrain import plan
    from tests.conftest import BASE_OVERRIDES, run_sfttrain

    overrides = [*BASE_OVERRIDES, "data.train_files=absent.parquet", "trainer.resume_mode=disable",
                 "trainer.resume_from_path=/runs/a/global_step_2"]
    message = ("trainer.resume_mode=disable starts afresh, so trainer.resume_from_path=/runs/a/global_step_2 would be "
               "ignored: drop trainer.resume_from_path to start afresh, or drop trainer.resume_mode=disable "
               "(trainer.resume_mode=resume_path) to resume from it")
    run = run_sfttrain(1, overrides, check=False)
    assert run.returncode == 2 and message in run.stdout, run.stdout
    assert plan.main([*overrides, "--nproc", "1"]) == 2
    assert message in capsys.readouterr().out.split("problems:")[1]




@pytest.mark.parametrize("overrides, message, fix", [
    (["data.apply_chat_template=false", "data.chat_template=t.jinja"],
     r"data.chat_template='t.jinja' with data.apply_chat_template=false: .*render nothing", "data.chat_template=null"),
    (["data.prompt_key=null", "data.apply_chat_template=false", "data.prompt_dict_keys=[a,b]"],
     r"data.prompt_dict_keys=\['a', 'b'\] with data.prompt_key=null: .*remove data.prompt_dict_keys",
     "data.prompt_dict_keys=null"),
    (["model.enable_gradient_checkpointing=false", "model.gradient_checkpointing_ratio=0.5"],
     r"model.gradient_checkpointing_ratio=0.5 shapes gradient checkpointing, which .*=false turns off",
     "model.enable_gradient_checkpointing=true"),
    (["model.enable_gradient_checkpointing=false", "model.recompute_attention=true"],
     r"model.recompute_attention=true shapes gradient checkpointing", "model.recompute_attention=auto"),
    (["model.compile_cpp_wrapper=true"], r"model.compile_cpp_wrapper=true .* model.compile=false runs them eagerly",
     "model.compile=true"),
    (["model.fp8_fast_accum_grads=false"], r"model.fp8_fast_accum_grads=false .* model.fp8=off runs none",
     "model.fp8_fast_accum_grads=true"),
    (["trainer.resume_mode=disable", "trainer.resume_allow_data_change=true"],
     r"trainer.resume_allow_data_change=true .* trainer.resume_mode=disable never resumes", "trainer.resume_mode=auto"),
])
def test_settings_that_another_setting_leaves_unread_are_refused(overrides, message, fix):
    """Each of these loaded and ran (2 steps of recipes/demo_cpu.yaml) with the key read by nothing: a
    template for raw text, nested keys under no prompt column, checkpointing shapes without
    checkpointing, a C++ wrapper for eager layers, FP8's accumulation without FP8, a resume switch
    with resumes off. Refused naming both keys; the fix the message names loads."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, *overrides])
    load_config(overrides=[*COMMON, *overrides, fix])


@pytest.mark.parametrize("overrides, note", [
    (["model.lora_alpha=64", "model.lora_dropout=0.1"],
     "model.lora_alpha=64, model.lora_dropout=0.1 ignored: model.lora_rank=0 trains every weight"),
    (["data.multiturn.enable=true", "data.prompt_key=prompt", "data.response_dict_keys=[text]"],
     "data.prompt_key='prompt', data.response_dict_keys=['text'] ignored: data.multiturn.enable=true reads "
     "conversations from data.multiturn.messages_key='messages'"),
    (["data.multiturn.messages_key=conversations"],
     "data.multiturn.messages_key='conversations' ignored: rows are prompt/response pairs"),
    (["optim.lr_scheduler=constant", "optim.min_lr_ratio=0.1"],
     "optim.min_lr_ratio=0.1 ignored: optim.lr_scheduler=constant never decays the LR"),
    (["optim.lr_warmup_steps=5", "optim.lr_warmup_steps_ratio=0.3"],
     "optim.lr_warmup_steps_ratio=0.3 ignored: optim.lr_warmup_steps=5 sets the warmup"),
    (["trainer.test_freq=10"], "trainer.test_freq=10 ignored: no data.val_files to validate on"),
    (["trainer.async_save=false", "trainer.async_save_writer=process"],
     "trainer.async_save_writer='process' ignored: trainer.async_save=false writes every checkpoint"),
    (["trainer.default_local_dir=/runs/a", "trainer.project_name=gsm8k", "trainer.logger=console"],
     "trainer.project_name='gsm8k' ignored: they name the wandb run and the default run folder"),
])
def test_keys_a_mode_does_not_read_are_said_at_start_up(overrides, note):
    """verl's command lines carry these into modes that never read them (LoRA keys in a full
    fine-tuning, prompt keys in a multi-turn run, ...): accepted, and one start-up line each (the run's
    and the preflight's) says it is ignored and what would make it count. Where the other setting
    reads it, or it is left at its default, nothing is said."""
    from sfttrain.config import moot_settings

    notes = moot_settings(load_config(overrides=[*COMMON, *overrides]))
    assert len(notes) == 1 and notes[0].startswith(f"  NOTE: {note}"), notes
    assert moot_settings(load_config(overrides=COMMON)) == []
    used = {"model.lora_alpha=64": "model.lora_rank=8", "data.multiturn.enable=true": "data.multiturn.enable=false",
            "data.multiturn.messages_key=conversations": "data.multiturn.enable=true",
            "optim.lr_scheduler=constant": "optim.lr_scheduler=cosine",
            "optim.lr_warmup_steps=5": "optim.lr_warmup_steps=-1",
            "trainer.test_freq=10": "data.val_files=v.parquet", "trainer.async_save=false": "trainer.async_save=true",
            "trainer.default_local_dir=/runs/a": "trainer.logger=wandb"}[overrides[0]]
    assert moot_settings(load_config(overrides=[*COMMON, *overrides, used])) == []


def test_runtime_notes_for_settings_a_device_or_layout_ignores():
    """forward_prefetch prefetches FSDP's all-gathers, which one device or DDP does not run; the C++
    wrapper launches GPU kernels (a CPU run takes the Python one): both were dropped without a word."""
    import types

    from sfttrain.parallel import describe_compile, describe_sharding

    cfg = load_config(overrides=[*COMMON, "model.fsdp_config.forward_prefetch=true"])
    assert describe_sharding(None, cfg, "single") == ("one device, not sharded; model.fsdp_config.forward_prefetch="
                                                      "true ignored: nothing is gathered "
                                                      "(it applies to sharded models)")
    cpu = types.SimpleNamespace(device=__import__("torch").device("cpu"))
    cfg = load_config(overrides=[*COMMON, "model.compile=true", "model.compile_cpp_wrapper=true"])
    chosen = types.SimpleNamespace(compile_cpp_wrapper=False, fuse_projections=False, fold_lora=False)  # what it reads
    assert "(model.compile_cpp_wrapper=true ignored on cpu: " in describe_compile(cfg, cpu, None, chosen)


def test_a_run_that_auto_places_on_the_cpu_says_so():
    """trainer.device=auto (verl's default is cuda) on a machine whose torch sees no GPU says so at
    start-up, naming why and the keys that decide; trainer.device=cpu, which says the CPU is meant, not."""
    import torch

    from sfttrain.distributed import describe_auto_cpu

    cpu = torch.device("cpu")
    note = describe_auto_cpu(load_config(overrides=COMMON), cpu)
    why = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA device (CUDA_VISIBLE_DEVICES="
    assert (len(note) == 1 and note[0].startswith("  NOTE: trainer.device=auto runs on the CPU: torch ")
            and why in note[0])
    assert "Set trainer.device=cuda to stop instead" in note[0], note
    assert describe_auto_cpu(load_config(overrides=[*COMMON, "trainer.device=cpu"]), cpu) == []


@pytest.mark.parametrize("override, message", [
    ("optim.betas=[0.9,1.5]", r"optim.betas=\[0.9, 1.5\]: each must lie in \[0, 1\)"),
    ("optim.betas=[-0.1,0.95]", r"optim.betas=\[-0.1, 0.95\]: each must lie in \[0, 1\)"),
    ("optim.eps=-1e-8", r"optim.eps=-1e-08 is negative; .*e\.g\. optim.eps=1e-08"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay=-0.1 is negative; .*e\.g\. optim.weight_decay=0.01"),
])
def test_adamw_values_torch_checks_only_in_its_defaults_are_refused(override, message):
    """sfttrain sets betas, eps and weight decay per parameter group, where torch's AdamW does not check
    them: a beta of 1.5 trained two steps into a NaN loss (exit code 4), a negative weight decay trained
    on. Each is refused at start-up (and listed by the preflight, which lists config_problems)."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, override])


def test_a_prompt_read_from_the_responses_cell_is_refused():
    """data.response_key=question beside the default prompt_key=question trained every question after
    itself, silently. One column read at two nested keys (verl's GSM8K command line) is accepted."""
    with pytest.raises(ConfigError, match=r"data.prompt_key='question' and data.response_key='question' read the same "
                                          r"cell: .*set data.response_key to the answers' column"):
        load_config(overrides=[*COMMON, "data.response_key=question"])
    load_config(overrides=[*COMMON, "data.prompt_key=extra_info", "data.response_key=extra_info",
                           "data.prompt_dict_keys=[question]", "data.response_dict_keys=[answer]"])


# names from Hugging Face's TrainingArguments, TRL, Axolotl and torchtune, and the key meant here
FOREIGN = {
    "learning_rate": "optim.lr", "num_train_epochs": "trainer.total_epochs", "epochs": "trainer.total_epochs",
    "num_epochs": "trainer.total_epochs", "max_steps": "trainer.total_training_steps",
    "per_device_train_batch_size": "data.micro_batch_size_per_gpu", "batch_size": "data.micro_batch_size_per_gpu",
    "max_seq_length": "data.max_length", "sequence_len": "data.max_length", "max_seq_len": "data.max_length",
    "gradient_checkpointing": "model.enable_gradient_checkpointing",
    "enable_activation_checkpointing": "model.enable_gradient_checkpointing", "lora_r": "model.lora_rank",
    "lora_rank": "model.lora_rank", "lora_alpha": "model.lora_alpha", "lora_dropout": "model.lora_dropout",
    "lora_target_modules": "model.target_modules", "warmup_ratio": "optim.lr_warmup_steps_ratio",
    "warmup_steps": "optim.lr_warmup_steps", "weight_decay": "optim.weight_decay", "max_grad_norm": "optim.clip_grad",
    "clip_grad_norm": "optim.clip_grad", "output_dir": "trainer.default_local_dir",
    "lr_scheduler_type": "optim.lr_scheduler", "seed": "trainer.seed", "save_steps": "trainer.save_freq",
    "logging_steps": "trainer.log_freq", "save_total_limit": "trainer.max_ckpt_to_keep",
    "model_name_or_path": "model.partial_pretrain", "base_model": "model.partial_pretrain",
    "resume_from_checkpoint": "trainer.resume_from_path", "adam_epsilon": "optim.eps", "report_to": "trainer.logger",
}
# the section a user would guess for some (each name alone, at the top level, is tried too)
GUESSED = {
    "optim": ("learning_rate", "warmup_ratio", "warmup_steps", "max_grad_norm", "lr_scheduler_type", "adam_epsilon",
              "seed"),
    "model": ("gradient_checkpointing", "lora_r", "lora_target_modules", "max_seq_length", "model_name_or_path"),
    "data": ("max_seq_length", "sequence_len", "per_device_train_batch_size", "batch_size"),
    "trainer": ("num_train_epochs", "max_steps", "output_dir", "learning_rate", "weight_decay"),
}


@pytest.mark.parametrize("key", sorted({*FOREIGN, *(f"{s}.{n}" for s, names in GUESSED.items() for n in names)}))
def test_names_from_other_trainers_point_to_the_key_meant(key):
    """optim.learning_rate suggested optim.min_lr_ratio, model.gradient_checkpointing the ratio: each name
    users bring, at the top level or in the section they guess, names the key it is here, which loads."""
    meant = FOREIGN[key.rpartition(".")[2]]
    suggestion = rf"^unknown config key '{re.escape(key)}'; did you mean {re.escape(meant)}\?"
    with pytest.raises(ConfigError, match=suggestion):
        load_config(overrides=[*COMMON, f"{key}=1"])
    value = {"data.max_length": "512", "trainer.logger": "console", "optim.lr_scheduler": "constant"}.get(meant, "1")
    load_config(overrides=[*COMMON, f"{meant}={value}"])


def test_every_name_from_other_trainers_is_said_at_once():
    """A whole TrainingArguments-style file: one error lists every name with its key, and a name with no
    key here (gradient accumulation, packing) says why."""
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[*COMMON, *(f"{name}=1" for name in FOREIGN), "gradient_accumulation_steps=4",
                               "packing=true"])
    lines = str(refused.value).splitlines()
    assert len(lines) == len(FOREIGN) + 2, lines
    assert "'gradient_accumulation_steps': no key here: data.train_batch_size is the global batch" in lines[-2]
    assert "'packing': no key here: sfttrain always packs" in lines[-1]


def test_a_value_outside_a_keys_choices_or_below_its_least_is_refused():
    """The schema names the values of the keys that take few, and the least of counts; every key outside
    them is refused at once, naming them."""
    from sfttrain.config.schema import schema_fields

    fields = {key: f.metadata for key, f in schema_fields()}
    chosen = [key for key, meta in fields.items() if meta["choices"]]
    counts = {key: meta["minimum"] for key, meta in fields.items() if meta["minimum"] is not None}
    assert {"data.truncation", "model.fp8", "trainer.async_save_writer", "model.fold_lora"} <= set(chosen)
    assert {"data.micro_batch_size_per_gpu", "trainer.nccl_timeout"} <= set(counts)
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[*COMMON, *(f"{key}=nonsense" for key in chosen),
                               *(f"{key}={least - 1}" for key, least in counts.items())])
    for key in chosen:
        assert re.search(rf"^{re.escape(key)}='nonsense' is not one of \[", str(refused.value), re.MULTILINE), key
    for key, least in counts.items():
        below = "negative" if least == 0 else f"below {least}"
        assert re.search(rf"^{re.escape(key)}={least - 1}(\.0)? is {below}; .*: e\.g\. {re.escape(key)}=",
                         str(refused.value), re.MULTILINE), key


@pytest.mark.parametrize("overrides, message", [
    (["data.prompt_key=[]"], r"data.prompt_key=\[\]: give a column name, null, or a list of columns"),
    (["data.prompt_key=[instruction,input]", "data.prompt_dict_keys=[q]"],
     r"data.prompt_dict_keys with data.prompt_key=\['instruction', 'input'\]: nested keys follow one column"),
    (["data.prompt_key=[instruction,answer]"], "read the same cell: each sample would be its answer after itself"),
])
def test_prompt_columns_that_cannot_make_a_prompt_are_refused(overrides, message):
    """A list of prompt columns (Alpaca's [instruction,input]) is joined into the prompt: an empty list, nested
    keys beside several columns, or the response's own column among them are refused naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, *overrides])
    assert load_config(overrides=[*COMMON, "data.prompt_key=[instruction,input]"]).data.prompt_key == ["instruction",
                                                                                                        "input"]
