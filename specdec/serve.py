"""`serve run specdec.serve:app model=... replicas=2 ...`: the Ray Serve application of a
`specdec serve` command line, for Ray's own tools (`serve run`, `serve deploy` config files).

Each argument is a `specdec serve` flag without its dashes (`speculative-model=models/draft`,
`num_speculative_tokens=4`; a flag that takes no value: `flag=true`). Ray's CLI owns the
cluster address and the HTTP host and port there (`serve run --address ...`, the config's
`http_options`), so --ray-address, --host and --port are not taken here. Replies to requests
whose replica died become OpenAI-style errors when the proxies run with
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specdec.server.proxy:middlewares (README: Scale-out).
"""

from __future__ import annotations

import json

from ray.serve import Application

from .server.replicas import application

NOT_HERE = ("ray-address", "host", "port")


def argv_of(args: dict) -> list[str]:
    """{"speculative_model": "x", "replicas": 2, "ignore_eos": True} -> ["--speculative-model", "x", ...]."""
    argv = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if flag[2:] in NOT_HERE:
            raise ValueError(f"{key}: set by Ray's CLI or config here (serve run --address, http_options)")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is False or str(value).lower() == "false":
            continue
        elif isinstance(value, dict):            # --speculative-config from a YAML mapping
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, *(map(str, value) if isinstance(value, (list, tuple)) else [str(value)])]
    return argv


def app(args: dict) -> Application:
    """Ray Serve's application builder: the arguments as `specdec serve` flags."""
    return application(argv_of(args))
