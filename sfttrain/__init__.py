import logging

# torchao (the fp8 extra, which transformers and peft import where it is installed) warns at import that its
# CUDA-only extensions do not load on this machine, and torch that its Enum registrations are deprecated:
# noise at the top of every command, --help included, about nothing sfttrain uses
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
