"""`vaed decode` and `vaed info`: the client package's commands, re-exported.

The code lives in `vaed_client.cli` so that `pip install ./client` has the
same commands (as `vaed-client`) without torch, diffusers or triton. This
module keeps the names `vaed/cli.py` and older scripts import.
"""

from __future__ import annotations

from vaed_client.cli import (  # noqa: F401
    DEFAULT_INFO_TIMEOUT_S,
    DEFAULT_SERVER,
    CommandError,
    add_connection_arguments,
    add_info_arguments,
    connect,
    load_latents,
    run_info,
)
from vaed_client.cli import add_decode_arguments as add_arguments  # noqa: F401
from vaed_client.cli import run_decode as run  # noqa: F401
from vaed_client.export import (  # noqa: F401
    AvWriter,
    FrameWriter,
    Mp4Writer,
    PngWriter,
    make_writer,
    output_paths,
)

__all__ = [
    "DEFAULT_INFO_TIMEOUT_S", "DEFAULT_SERVER", "CommandError", "add_connection_arguments", "add_info_arguments",
    "connect", "load_latents", "run_info", "add_arguments", "run", "AvWriter", "FrameWriter", "Mp4Writer",
    "PngWriter", "make_writer", "output_paths",
]
