"""Write the checked-in list of `sglang.launch_server` flags from a released SGLang's own argument parser.

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl && (cd /tmp/sgl && unzip -q sglang-*.whl 'sglang/*')
    pip install --target /tmp/sgl/deps msgspec orjson
    PYTHONPATH=/tmp/sgl/deps python tests/extract_sglang_flags.py /tmp/sgl 0.5.23 \
        > scripts/dflash_pipeline/generation/sglang_flags.json

It imports `sglang.srt.server_args` from the unpacked wheel and runs `ServerArgs.add_cli_args` on a plain
argparse parser, then records every option: its spellings, whether it takes a value (and how many), its
choices and its value type. Heavy dependencies that sglang imports at module level (torch kernels, CUDA
libraries) are replaced by inert stand-in modules; only imports made *from sglang's own files* are stubbed,
so the installed libraries keep working. Not a test: a tool to refresh the list for a new SGLang release.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types


class _Base:
    def __init_subclass__(cls, **kw):
        pass

    def __init__(self, *a, **k):
        pass

    def __class_getitem__(cls, k):
        return cls


class _Stub(types.ModuleType):
    """A module (and any attribute of it) that can be imported, called, subclassed and subscripted."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _Stub(f"{self.__name__}.{name}")
        stub.__path__ = []
        return stub

    def __call__(self, *a, **k):
        return _Stub("call")

    def __mro_entries__(self, bases):
        return (_Base,)

    def __iter__(self):
        return iter(())

    def __or__(self, other):
        return self

    def __getitem__(self, key):
        return self


class _StubMissing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stubs a module that is not installed, only when sglang's own code imports it."""

    def find_spec(self, name, path, target=None, _this=__file__):
        top = name.split(".")[0]
        if top == "sglang" or top in sys.stdlib_module_names:
            return None
        if top in sys.modules and not isinstance(sys.modules[top], _Stub):
            return None
        frame = sys._getframe(1)
        while frame and ("importlib" in frame.f_code.co_filename or frame.f_code.co_filename == _this):
            frame = frame.f_back
        if frame is None or "/sglang/" not in frame.f_code.co_filename:
            return None
        for finder in sys.meta_path:
            if finder is not self and _safe_find(finder, name, path, target):
                return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _safe_find(finder, name, path, target):
    try:
        return finder.find_spec(name, path, target)
    except Exception:
        return None


def _kind(action: argparse.Action) -> dict:
    takes = {None: "one", 0: "none", "?": "optional", "*": "any", "+": "some"}.get(action.nargs)
    if takes is None:
        raise SystemExit(f"unexpected nargs {action.nargs!r} for {action.option_strings}")
    type_name = getattr(action.type, "__name__", None)
    entry = {"names": list(action.option_strings), "value": takes,
             "type": type_name if type_name in ("int", "float") else "str"}
    if action.choices is not None:
        entry["choices"] = [str(c) for c in action.choices]
    return entry


def main() -> None:
    root, version = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    sys.meta_path.append(_StubMissing())
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    flags = sorted((_kind(a) for a in parser._actions if a.option_strings), key=lambda e: e["names"][0])
    head = {"sglang_version": version,
            "source": f"sglang=={version} wheel: sglang.srt.server_args.ServerArgs.add_cli_args"}
    body = ",\n".join("  " + json.dumps(f) for f in flags)  # one flag a line: diffs stay readable
    sys.stdout.write(json.dumps(head)[:-1] + ', "flags": [\n' + body + "\n]}\n")


if __name__ == "__main__":
    main()
