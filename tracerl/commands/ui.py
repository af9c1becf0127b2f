"""A read-only web viewer over the store: what the policy is trained on, token by token.

Pages: Rounds (reward, held-out success, loss, KL, clip fraction and staleness per round, as
charts, and the round manifest: settings, git sha, checkpoint, publish time); Rollouts (a table
filtered, sorted and paginated in SQL, with what `tracerl doctor` would flag); a rollout (its span
tree as a timeline, each LLM call as its transition: prompt messages, tools, the response with each
token coloured by its sampling logprob or by its advantage, token ids on hover, the reward and how it
was credited, and why token_source is not `gateway` when it is not); a task's group (its rollouts
side by side with reward and advantage, per policy version); Quarantine and doctor.

The store is opened as `tracerl sql` opens it (DuckDB views, file access off): nothing is written.
Pages notice new rounds and rollouts while `collect` and `train --watch` run. Everything is served
from the package (no CDN), so it works offline. It binds 127.0.0.1 unless --listen says otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from store.layout import StoreLayout, default_store
from tracerl.options import UsageError, add_options, from_args, opt

EPILOG = """\
examples:
  tracerl ui                                        # ./tracerl-store on http://127.0.0.1:8700
  tracerl ui --store /data/tracerl --listen 127.0.0.1:9000
  tracerl ui --api-key "$(openssl rand -hex 16)"    # prints http://127.0.0.1:8700/?token=…: open it once
  ssh -L 8700:127.0.0.1:8700 trainer-host           # to view a remote store, forward the port

with --api-key, a browser opens the printed address once: the token becomes an HttpOnly cookie
and the address bar drops it; scripts send `Authorization: Bearer KEY` instead.
"""


@dataclass
class UiCommandConfig:
    store: str = opt(default_store(), "store directory to view (opened read-only)", metavar="DIR",
                     env="TRACERL_STORE")
    listen: str = opt("127.0.0.1:8700", "HOST:PORT to serve on (port 0: any free port)")
    api_key: str = opt("", "require this token on every request (see below); empty: none", metavar="KEY",
                       env="TRACERL_UI_API_KEY")
    tokenizer: str = opt("", "model directory whose tokenizer.json turns token ids into text (default: the "
                         "base model in the rounds manifest)", metavar="DIR")
    poll_s: float = opt(3.0, "how often open Rounds/Rollouts pages check the store for new data, seconds")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, UiCommandConfig)


def run(args: argparse.Namespace) -> int:
    from serving.asgi import parse_listen
    from tracerl.signals import stop_requested, wait_for_stop
    from ui.app import UiConfig, serve

    cfg = from_args(UiCommandConfig, args)
    layout = StoreLayout.at(cfg.store)
    if not layout.root.is_dir():
        raise UsageError(f"--store {cfg.store} is not a directory; point --store (or TRACERL_STORE) at the "
                         "directory `tracerl collect --store DIR` writes")
    if cfg.poll_s <= 0:
        raise UsageError(f"--poll-s must be above 0, got {cfg.poll_s:g}")
    try:
        host, port = parse_listen(cfg.listen, 8700)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        server = serve(UiConfig(store=str(layout.root), token=cfg.api_key or None, tokenizer=cfg.tokenizer or None,
                                poll_s=cfg.poll_s), host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on {cfg.listen}: {e.strerror or e}; pick another --listen port") from None
    try:
        stop = stop_requested()
        url = server.url + ("/?token=" + cfg.api_key if cfg.api_key else "/")
        print(f"tracerl ui: {url}  (store {layout.root}, read-only; Ctrl-C stops)", flush=True)
        wait_for_stop(stop)
    finally:
        server.stop()
    return 0
