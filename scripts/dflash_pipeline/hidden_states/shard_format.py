"""Compatibility only: the shard format now lives in layout.py (the file layout), codec.py, writer.py,
reader.py, stream.py and verify.py (`hidden-verify`). Import from those; this module goes once nothing
imports it."""

from dflash_pipeline.hidden_states.codec import Codec, EncodedSample, merge_planes, split_planes  # noqa: F401
from dflash_pipeline.hidden_states.layout import CODECS, FILE_EXTENSION, STORED_DTYPES, ShardFormatError  # noqa: F401
from dflash_pipeline.hidden_states.reader import MAX_OPEN_FILES, HiddenStateShardReader  # noqa: F401
from dflash_pipeline.hidden_states.stream import iter_shard_samples  # noqa: F401
from dflash_pipeline.hidden_states.verify import add_arguments, run, verify_shard  # noqa: F401
from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter, write_shard  # noqa: F401
