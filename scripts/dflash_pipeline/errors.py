"""Errors whose message is the whole story for the user: the CLI prints them without a traceback."""


class PipelineError(Exception):
    """A problem with the user's input or configuration, described by file, record and reason."""


class CorruptInputError(PipelineError):
    """A raw input file is truncated or corrupt at a known byte offset."""

    def __init__(self, path: str, offset: int, records_read: int, reason: str):
        self.path, self.offset, self.records_read, self.reason = path, offset, records_read, reason
        super().__init__(
            f"{path}: corrupt or truncated at byte offset {offset} (decompressed stream) after "
            f"{records_read} complete records: {reason}. Set ingest.on_corrupt: salvage to keep the "
            f"{records_read} records before the damage."
        )
