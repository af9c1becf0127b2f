"""ui: ``tracerl ui``, the read-only trajectory viewer over the store's views, on ``httpshell``.

Modules, one job each: ``store`` (the read-only connection, reopened as files arrive), ``filters``
(the rollouts table's query string -> SQL parameters), ``pages`` (what each page reads), ``colors``,
``timeline``, ``charts``, ``messages``, ``tokens`` (pure shaping for the templates), and ``app`` (the
Starlette routes, the token gate and the templates in ``templates/``, assets in ``static/``).
It never writes to the store.
"""
