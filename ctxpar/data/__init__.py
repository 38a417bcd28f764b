"""Data: the passkey task, .bin/.idx token files, the DP/CP-aware sample stream (dynamic
CP's per-document stream and schedule: ctxpar/dynamic_cp/)."""
from .indexed import DataError, IndexedDataset, IndexedDatasetWriter
from .loader import SampleStream, TokenWindows, build_source, shard_batch
from .pipeline import Data, ShardedStream, build_data, build_sample_stream
from .passkey import IGNORE_INDEX, PasskeyTask, passkey_accuracy, passkey_correct
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer", "Data", "DataError", "HFTokenizer", "IGNORE_INDEX", "IndexedDataset",
    "IndexedDatasetWriter", "PasskeyTask", "SampleStream", "TokenWindows",
    "build_sample_stream", "build_source", "load_tokenizer", "passkey_accuracy",
    "passkey_correct", "shard_batch", "ShardedStream", "build_data",
]
