"""The read-only dashboard (``fulmen dashboard``): runs and their steps, rollouts and their traces, dead letters.

:mod:`fulmen.dashboard.queries` holds the SQL and its validated parameters; :mod:`fulmen.dashboard.app` the
aiohttp server, its pages (``static/``) and the JSON they poll.
"""

from fulmen.dashboard.app import Dashboard, dashboard_reader
from fulmen.dashboard.queries import DashboardQueries, FilterError

__all__ = ["Dashboard", "DashboardQueries", "FilterError", "dashboard_reader"]
