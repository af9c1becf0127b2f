"""A read-only web viewer over the store: what the policy is trained on, token by token.

Pages: Rounds (reward, held-out success, loss, KL, clip fraction and staleness per round, as
charts, and the round manifest: settings, git sha, checkpoint, publish time); Rollouts (a table
filtered, sorted and paginated in SQL, with what `tracerl doctor` would flag); a rollout (its span
tree as a timeline, each LLM call as its transition: prompt messages, tools, the response with each
token coloured by its sampling logprob or by its advantage, token ids on hover, the reward and how it
was credited, and why token_source is not `gateway` when it is not); a task's group (its rollouts
side by side with reward and advantage, per policy version); Quarantine and doctor.

The store is opened as `tracerl sql` opens it (DuckDB views, file access off): nothing is written.
It may be a directory or s3://bucket/prefix (endpoint and credentials from the standard AWS_*
variables, as for `tracerl sql`); the tokenizer that decodes token ids is always a local directory.
Pages notice new rounds and rollouts while `collect` and `train --watch` run. Everything is served
from the package (no CDN), so it works offline. It binds 127.0.0.1 unless --listen says otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pyarrow.fs as pafs

from options import UsageError, add_options, from_args, opt
from store.layout import default_store
from store.location import StoreLocation, parse_store

EPILOG = """\
examples:
  tracerl ui                                        # ./tracerl-store on http://127.0.0.1:8700
  tracerl ui --store /data/tracerl --listen 127.0.0.1:9000
  tracerl ui --store s3://bucket/prefix --tokenizer ./base-model   # a bucket store; AWS_* variables apply
  tracerl ui --api-key "$(openssl rand -hex 16)"    # prints http://127.0.0.1:8700/?token=…: open it once
  ssh -L 8700:127.0.0.1:8700 trainer-host           # to view a remote store, forward the port

with --api-key, a browser opens the printed address once: the token becomes an HttpOnly cookie
and the address bar drops it; scripts send `Authorization: Bearer KEY` instead.
"""


@dataclass
class UiCommandConfig:
    store: str = opt(default_store(), "store directory, or s3://bucket/prefix, to view (opened read-only)",
                     metavar="DIR", env="TRACERL_STORE")
    listen: str = opt("127.0.0.1:8700", "HOST:PORT to serve on (port 0: any free port)")
    api_key: str = opt("", "require this token on every request (see below); empty: none", metavar="KEY",
                       env="TRACERL_UI_API_KEY")
    tokenizer: str = opt("", "model directory whose tokenizer.json turns token ids into text (default: the "
                         "base model in the rounds manifest)", metavar="DIR")
    poll_s: float = opt(3.0, "how often open Rounds/Rollouts pages check the store for new data, seconds")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, UiCommandConfig)


def where(loc: StoreLocation) -> str:
    """How the viewer names the store: the resolved directory, or the URI as given."""
    return loc.root if loc.is_local else loc.uri


def existing_store(store: str) -> StoreLocation:
    """``--store`` as a location, refused with a UsageError (no traceback) when there is nothing to view:
    a missing local directory, or a bucket prefix that holds nothing or cannot be reached."""
    try:
        loc = parse_store(store)
        if loc.is_local:
            if loc.fs.get_file_info(loc.root).type != pafs.FileType.Directory:
                raise UsageError(f"--store {store} is not a directory; point --store (or TRACERL_STORE) at the "
                                 "directory `tracerl collect --store DIR` writes")
            return loc
        found = loc.exists()
    except (OSError, ValueError) as e:  # pyarrow's errors: no such bucket, access denied, unreachable endpoint
        raise UsageError(f"--store {store}: cannot read it ({str(e).strip().splitlines()[0]}); check the URI, "
                         "the AWS_* variables (endpoint, credentials, region) and the bucket") from None
    if not found:
        raise UsageError(f"--store {store}: nothing is stored there (no such bucket, or an empty prefix); point "
                         "--store at the s3://bucket/prefix `tracerl collect --store` writes")
    return loc


def run(args: argparse.Namespace) -> int:
    from serving.asgi import parse_listen
    from tracerl.signals import stop_requested, wait_for_stop
    from ui.app import UiConfig, serve

    cfg = from_args(UiCommandConfig, args)
    loc = existing_store(cfg.store)
    if cfg.poll_s <= 0:
        raise UsageError(f"--poll-s must be above 0, got {cfg.poll_s:g}")
    try:
        host, port = parse_listen(cfg.listen, 8700)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        server = serve(UiConfig(store=loc, token=cfg.api_key or None, tokenizer=cfg.tokenizer or None,
                                poll_s=cfg.poll_s), host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on {cfg.listen}: {e.strerror or e}; pick another --listen port") from None
    try:
        stop = stop_requested()
        url = server.url + ("/?token=" + cfg.api_key if cfg.api_key else "/")
        print(f"tracerl ui: {url}  (store {where(loc)}, read-only; Ctrl-C stops)", flush=True)
        wait_for_stop(stop)
    finally:
        server.stop()
    return 0
