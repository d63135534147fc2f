"""Errors whose message is the whole story for the user: the CLI prints them without a traceback."""

import signal


class PipelineError(Exception):
    """A problem with the user's input or configuration, described by file, record and reason."""


class CorruptInputError(PipelineError):
    """A raw input file is truncated or corrupt at a known byte offset."""

    def __init__(self, path: str, offset: int, records_read: int, reason: str, compressed: bool = False,
                 kind: str = "truncated", records_after: int | None = None):
        self.path, self.offset, self.records_read, self.reason = path, offset, records_read, reason
        self.kind, self.records_after = kind, records_after
        where = f"byte offset {offset}" + (" of the decompressed stream" if compressed else "")
        if kind == "damaged":  # mid-file: the reader resynced past it and counted what follows
            text = (f"{path}: damaged record at {where}: {reason}. {records_read} complete records before it and "
                    f"{records_after} records after it (counted by a scan) are intact; set ingest.on_corrupt: "
                    f"salvage to keep those {records_read + records_after} and quarantine the damaged bytes.")
        else:
            after = {"truncated": "no records follow (the file ends there)",
                     "corrupt": "the records after it cannot be decompressed (how many is unknown)",
                     "trailing data": "every record was read; data follows the array's closing ']'"}.get(kind, kind)
            what = {"truncated": "truncated", "corrupt": "corrupt compressed data"}.get(kind, "damaged")
            text = (f"{path}: {what} at {where} after {records_read} complete records: {reason}; {after}. Set "
                    f"ingest.on_corrupt: salvage to keep the {records_read} records before the damage.")
        super().__init__(text)


class StoppedBySignal(PipelineError):
    """A stage stopped on request (SIGTERM/SIGINT) after saving its state; the CLI exits 128 + the signal's number,
    as a job killed by it would, so a scheduler counts the job as not done."""

    def __init__(self, stage: str, signum: int, where: str):
        self.signum = signum
        super().__init__(f"{stage}: stopped by {signal.Signals(signum).name} {where}; rerun the same command to "
                         "resume from it")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
