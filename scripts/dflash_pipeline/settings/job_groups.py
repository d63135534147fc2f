"""Job groups: one job of a stage takes the K consecutive shards of one source file (K: the stage's
shards_per_job; 1 is a group of one), so a process start-up, a model load or a server start-up is paid once per
group. A shard `{src}-NNNNN` is in group `{src}-{letter}MMMMM` with M = N // K (each stage has its letter, so
its group directories cannot be mistaken for another's). A changed shard redoes only its own group."""

from __future__ import annotations


class JobGroups:
    def __init__(self, letter: str, size: int):
        self.letter, self.size = letter, size
        # the {group} wildcard: a source name, the letter, five digits
        self.pattern = rf"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*?-{letter}\d{{5}}"
        self._indexed: tuple[tuple, dict] = ((), {})  # (the shards, {group: members}) of the last call

    def of(self, shard: str) -> str:
        src, k = shard.rsplit("-", 1)
        return f"{src}-{self.letter}{int(k) // self.size:05d}"

    def groups(self, shards) -> list[str]:
        """The groups of `shards`, each once, in the order of their first shard."""
        return list(dict.fromkeys(self.of(s) for s in shards))

    def members(self, group: str, shards) -> list[str]:
        """The shards of `group` among `shards` (the manifest's), in their order. Input functions ask once per
        group and rule with the same shard list: it is indexed once (a scan per call was shards x groups)."""
        shards = tuple(shards)
        if shards != self._indexed[0]:
            index: dict[str, list[str]] = {}
            for s in shards:
                index.setdefault(self.of(s), []).append(s)
            self._indexed = (shards, index)
        return list(self._indexed[1].get(group, ()))


def link_out(*pairs: tuple[str, str]) -> str:
    """The shell command of the local job that takes a shard's files out of its group's directory, given (file
    in the group, output) pairs: a hard link (the same bytes, no copy), a copy where the file system has none.
    Touched, as a copy would be: a link keeps the file's time, older than the group's Snakemake timestamp, and
    the job would otherwise look out of date forever."""
    links = " && ".join(f"(ln -f {src} {dst} 2>/dev/null || cp {src} {dst}) && touch {dst}" for src, dst in pairs)
    return f"({links}) > {{log:q}} 2>&1"
