"""The names users bring: verl's keys, Hydra's and verl's PPO sections, and other trainers' names."""

from __future__ import annotations

import difflib
import os
from typing import Any, Iterator

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from sfttrain.config.schema import Config

# verl spellings accepted as synonyms: verl's key -> the schema's
ALIASES = {
    "trainer.save_interval": "trainer.save_freq",
    "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
    "optim.warmup_style": "optim.lr_scheduler",
    "model.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",  # verl's actor/model block spelling
    "model.use_remove_padding": "use_remove_padding",
}

# verl keys that mean nothing here, dropped with why, so that verl's scripts run as they are
IGNORED_VERL_KEYS = {
    "trainer.default_hdfs_dir": "verl copies each checkpoint to HDFS; sfttrain writes checkpoints to "
                                "trainer.default_local_dir only (copy that folder with your own tool)",
    "data.micro_batch_size": "verl's deprecated global micro-batch, which its SFT trainer never reads either; "
                             "the micro-batch is data.micro_batch_size_per_gpu",
    "data.use_shm": "verl copies the data files through /dev/shm; sfttrain streams them where they are",
    "data.processor": "verl's processor settings for image data (data.image_key); images are not trained here",
    "model.use_shm": "verl copies the model to /dev/shm before loading it; sfttrain reads model.partial_pretrain "
                     "where it is",
}

# verl's sft_trainer.yaml keys for what sfttrain lacks: null (their value there) is dropped, a value refused
NULL_ONLY_VERL_KEYS = {
    "data.custom_cls": "verl's custom Dataset class; sfttrain reads the forms of rows in the README (Your own data): "
                       "convert the data to one of them",
    "data.image_key": "images are not trained here (text-only causal LMs)",
    "model.external_lib": "verl imports that module to register a custom model; sfttrain loads Hugging Face model "
                          "folders (model.trust_remote_code=true runs a folder's own code)",
    "trainer.resume_path": "verl's former resume key: use trainer.resume_mode=resume_path "
                           "trainer.resume_from_path=<checkpoint or run folder>",
}

# verl's trainer.checkpoint section: what its checkpoints hold (hf_model: a Hugging Face copy)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
CHECKPOINT_KEYS = ("trainer.checkpoint.save_contents", "trainer.checkpoint.load_contents")

# top-level sections of a Hydra config file, which plain YAML does not have
HYDRA_ONLY = {"defaults": "Hydra's list of other config files to compose is not read here: put their keys into "
                          "this file itself",
              "hydra": "Hydra's own settings (its output folder, logging, sweeps) mean nothing here: remove the "
                       "hydra section (the run folder is trainer.default_local_dir)"}

# verl's PPO/GRPO trainer's keys, which templates mix with SFT's: the closest SFT key would mislead
PPO_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "algorithm", "custom_reward_function", "ray_init",
                "ray_kwargs")
PPO_KEYS = ("trainer.critic_warmup", "trainer.val_before_train", "trainer.balance_batch", "data.max_prompt_length",
            "data.max_response_length", "data.return_raw_chat", "data.filter_overlong_prompts")

# other trainers' names (in any section, or none) -> the key here; the schema's own names in another
# section are found without this table
FOREIGN_NAMES = {name: key for names, key in {
    "learning_rate": "optim.lr", "num_train_epochs num_epochs epochs": "trainer.total_epochs",
    "max_steps": "trainer.total_training_steps", "global_batch_size": "data.train_batch_size",
    "per_device_train_batch_size micro_batch_size batch_size": "data.micro_batch_size_per_gpu",
    "max_seq_length max_seq_len sequence_len seq_length cutoff_len model_max_length": "data.max_length",
    "gradient_checkpointing activation_checkpointing enable_activation_checkpointing":
        "model.enable_gradient_checkpointing",
    "lora_r use_peft": "model.lora_rank", "lora_target_modules lora_attn_modules": "model.target_modules",
    "warmup_ratio": "optim.lr_warmup_steps_ratio", "warmup_steps num_warmup_steps": "optim.lr_warmup_steps",
    "max_grad_norm clip_grad_norm gradient_clipping": "optim.clip_grad", "lr_scheduler_type": "optim.lr_scheduler",
    "adam_beta1 adam_beta2": "optim.betas", "adam_epsilon": "optim.eps", "output_dir": "trainer.default_local_dir",
    "save_steps": "trainer.save_freq", "eval_steps": "trainer.test_freq",
    "save_total_limit": "trainer.max_ckpt_to_keep",
    "logging_steps log_every_n_steps": "trainer.log_freq", "resume_from_checkpoint": "trainer.resume_from_path",
    "model_name_or_path base_model pretrained_model_name_or_path": "model.partial_pretrain",
    "report_to metric_logger": "trainer.logger", "wandb_project": "trainer.project_name",
    "run_name wandb_name": "trainer.experiment_name", "dataloader_num_workers": "data.num_workers",
    "torch_compile": "model.compile", "use_liger_kernel": "model.use_liger",
    "bf16": "model.fsdp_config.mixed_precision", "dataset_text_field": "data.response_key",
}.items() for name in names.split()}
# where the key here differs from the name's meaning there
FOREIGN_NOTES = {
    "data.micro_batch_size_per_gpu": "one forward's samples on one rank; the global batch is data.train_batch_size, "
                                     "the accumulation follows from the two",
    "model.lora_rank": "> 0 turns LoRA on",
    "optim.betas": "both, as [beta1, beta2]",
    "model.fsdp_config.mixed_precision": "true, the default, computes in bf16",
    "data.response_key": "whole texts: with data.prompt_key=null and data.apply_chat_template=false",
}
# other trainers' names with no key here, and why
FOREIGN_WITHOUT_KEY = {
    "gradient_accumulation_steps": "no key here: data.train_batch_size is the global batch and "
                                   "data.micro_batch_size_per_gpu one forward's; the accumulation follows from them",
    **dict.fromkeys(("packing", "sample_packing"), "no key here: sfttrain always packs rows padding-free; remove it"),
}


def unknown_key_problem(key: str, known: set[str]) -> str:
    """Why an unknown key is someone else's and what to write here, else the known key closest to it."""
    top, leaf = key.split(".")[0], key.rpartition(".")[2]
    if top in HYDRA_ONLY:
        return f"{top}: {HYDRA_ONLY[top]}"
    if top in PPO_SECTIONS or key in PPO_KEYS:
        return (f"{top if top in PPO_SECTIONS else key}: a key of verl's PPO/GRPO trainer (ppo_trainer.yaml), not of "
                "its SFT trainer, which sfttrain replaces: remove it. A step here is data.train_batch_size samples "
                "over all data-parallel ranks, each rank's share run as micro-batches of "
                "data.micro_batch_size_per_gpu (the start-up prints the arithmetic)")
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf and k not in ALIASES]
    if len(same_leaf) == 1:
        return f"unknown config key {key!r}; did you mean {same_leaf[0]}?"
    if leaf in FOREIGN_NAMES:
        target = FOREIGN_NAMES[leaf]
        note = f" ({FOREIGN_NOTES[target]})" if target in FOREIGN_NOTES else ""
        return f"unknown config key {key!r}; did you mean {target}?{note}"
    if leaf in FOREIGN_WITHOUT_KEY:
        return f"unknown config key {key!r}: {FOREIGN_WITHOUT_KEY[leaf]}"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"unknown config key {key!r}" + (f"; did you mean {close[0]}?" if close else "")


def translate(layer: DictConfig) -> list[str]:
    """verl's spellings to the schema's, its meaningless keys dropped (each said once), in place; the
    problems of those it refuses."""
    problems = []
    for old, new in ALIASES.items():
        if (value := pop(layer, old)) is ABSENT:
            continue
        if OmegaConf.select(layer, new, default=ABSENT) is not ABSENT:
            problems.append(f"both {old} and {new} are set; {old} is verl's name for {new}: keep one")
        else:
            OmegaConf.update(layer, new, value, force_add=True)
    problems += _checkpoint_contents(layer)
    for key, why in IGNORED_VERL_KEYS.items():
        if (value := pop(layer, key)) is not ABSENT:
            _say(f"sfttrain: ignoring {key}={_as_typed(value)}: {why}")
    for key, why in NULL_ONLY_VERL_KEYS.items():
        if (value := pop(layer, key)) is ABSENT:
            continue
        plain = _plain(value)
        if plain not in (None, "", {}, []) and not (isinstance(plain, dict) and all(v is None for v in plain.values())):
            problems.append(f"{key}={plain!r}: {why}; remove the key (or set it to null)")
        else:
            _say(f"sfttrain: ignoring {key}={_as_typed(plain)} (verl's key, none given): {why}")
    return problems


ABSENT = object()


def pop(layer: DictConfig, key: str) -> Any:
    """Removes a dotted key from the layer, returning its value (ABSENT where it has none)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(layer, parent, default=None, throw_on_missing=False) if parent else layer
    if not isinstance(node, DictConfig) or leaf not in node:
        return ABSENT
    return node.pop(leaf)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _as_typed(value: Any) -> str:
    """A value as the user typed it (null, not Python's None)."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**9, sort_keys=False)
    return text.removesuffix("...\n").strip()


def _say(line: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(line, flush=True)


def _checkpoint_contents(layer: DictConfig) -> list[str]:
    """Drops verl's trainer.checkpoint section (sfttrain's checkpoints hold everything; hf_model
    is trainer.save_hf=true); an unknown content or key is a problem."""
    section = OmegaConf.select(layer, "trainer.checkpoint", default=None, throw_on_missing=False)
    if not isinstance(section, DictConfig):
        return []
    raw = OmegaConf.to_container(layer.trainer.pop("checkpoint"), resolve=False)  # load_contents: ${...save_contents}
    saved = raw.get("save_contents")
    contents = [saved] if isinstance(saved, str) else list(saved or [])
    unknown = sorted(set(raw) - {key.rpartition(".")[2] for key in CHECKPOINT_KEYS})
    if unknown or (bad := [c for c in contents if c not in CHECKPOINT_CONTENTS]):
        return [f"trainer.checkpoint.{unknown[0]}: unknown key; verl's trainer.checkpoint section has save_contents "
                "and load_contents only" if unknown else f"trainer.checkpoint.save_contents: {bad} unknown; verl's "
                f"contents are {list(CHECKPOINT_CONTENTS)}"]
    if "hf_model" in contents and OmegaConf.select(layer, "trainer.save_hf", default=None) is None:
        OmegaConf.update(layer, "trainer.save_hf", True, force_add=True)
    hf = ("; hf_model is trainer.save_hf=true (set here): the final checkpoint exported into its huggingface/, "
          "any other one by python -m sfttrain.export") if "hf_model" in contents else ""
    _say(f"sfttrain: ignoring trainer.checkpoint ({', '.join(f'{k}={v}' for k, v in raw.items())}): sfttrain's "
         f"checkpoints always hold the model, optimizer and extra state (data position, RNG), and a resume reads "
         f"them all{hf}")
    return []


def verl_switch_problems(cfg: Config) -> Iterator[str]:
    """verl keys accepted only where they have their effect: a value that would be ignored is refused."""
    d, m, fsdp = cfg.data, cfg.model, cfg.model.fsdp_config
    if d.use_dynamic_bsz is True and d.max_token_len_per_gpu is None:  # the token budget alone decides here
        yield (f"data.use_dynamic_bsz=true packs each micro-batch up to data.max_token_len_per_gpu tokens, "
               f"which is not set (verl's default is 8192): set it, at least data.max_length={d.max_length},"
               f" e.g. data.max_token_len_per_gpu={max(8192, d.max_length)}")
    if d.use_dynamic_bsz is False and d.max_token_len_per_gpu is not None:
        yield (f"data.use_dynamic_bsz=false runs micro-batches of data.micro_batch_size_per_gpu="
               f"{d.micro_batch_size_per_gpu} samples, but data.max_token_len_per_gpu={d.max_token_len_per_gpu} packs "
               "them by tokens instead (verl ignores it there): remove data.max_token_len_per_gpu for micro-batches "
               "of samples, or set data.use_dynamic_bsz=true for token budgets")
    if not d.balance_dp_token:
        yield ("data.balance_dp_token=false: sfttrain always spreads each step's samples over ranks and "
               "micro-batches balanced by cost (the loss does not depend on the split); remove the key")
    if m.strategy != "fsdp2":
        yield (f"model.strategy={m.strategy!r}: sfttrain implements FSDP2 (fully_shard) only; set "
               "model.strategy=fsdp2 (sharding_strategy, fsdp_size, mixed precision and offload keep "
               "their meaning)")
    mp = fsdp.mixed_precision
    if isinstance(mp, dict) and mp.get("buffer_dtype", "fp32") != "fp32":
        yield (f"model.fsdp_config.mixed_precision.buffer_dtype={mp['buffer_dtype']!r}: sfttrain keeps "
               "buffers (rotary frequencies) in fp32, where rounding them would shift every position; "
               "remove the key or set it to fp32")
    if not cfg.use_remove_padding:
        yield ("use_remove_padding=false: sfttrain always trains padding-free (packed rows give the same "
               "loss as padded ones, without the pad compute); remove the key")
