"""The child processes' entry point: ``python -m appliance.audio.device worker FD PARAMS_JSON`` (the
audio worker, :func:`.worker.run`) or ``python -m appliance.audio.device list`` (:func:`.listing.list_main`).

Here rather than in the modules themselves so that ``-m`` never runs a module the package has already
imported (runpy's double import)."""

import json
import sys

from .listing import list_main
from .worker import run

if len(sys.argv) == 4 and sys.argv[1] == "worker":
    sys.exit(run(int(sys.argv[2]), json.loads(sys.argv[3])))
if sys.argv[1:] == ["list"]:
    list_main()
print("usage: python -m appliance.audio.device worker FD PARAMS_JSON | list", file=sys.stderr)
sys.exit(2)
