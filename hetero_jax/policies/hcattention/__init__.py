"""HCAttention, with its calibration beside it: the policy (``policy.py``: approximate scores on the device,
values summed on the host), the key codebook's file format and training (``codebook.py``) and the handler of
``hetero-jax profile --method hcattention`` (``cli.py``)."""

from hetero_jax.policies.hcattention.codebook import KeyCodebook, load_codebook, shipped_codebooks, train_codebook
from hetero_jax.policies.hcattention.attention import HCState, mass_set
from hetero_jax.policies.hcattention.policy import HCAttention

__all__ = ["HCAttention", "HCState", "KeyCodebook", "load_codebook", "mass_set", "shipped_codebooks",
           "train_codebook"]
