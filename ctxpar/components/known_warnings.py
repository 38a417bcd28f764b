"""Third-party warnings that tell a ctxpar user nothing, silenced one by one.

Every filter names the exact message, its category and the module Python attributes it
to, so any other warning, and these same words from anywhere else, still reach the console.
train.py and generate.py install them before they start DeepSpeed; every rank runs them, so every rank
has them. Add one only for a warning that is printed on every run, that the user cannot act
on, and that ctxpar's own code does not cause (fix ctxpar's own calls instead).
"""
from __future__ import annotations

import warnings

# (message regex, category, module regex): see filter_known_warnings.
KNOWN_WARNINGS = (
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single;
    # DeepSpeed's comm backend (deepspeed/comm/torch.py) still calls it for ZeRO's parameter
    # all-gather after every optimizer step, on every rank. torch's @deprecated wrapper makes
    # the warning point at torch.distributed.c10d_logger, whoever the caller is; ctxpar
    # itself never calls the function (tests/test_train.py checks the console).
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger"),
)


def filter_known_warnings() -> None:
    """Install the KNOWN_WARNINGS filters in this process (idempotent)."""
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
