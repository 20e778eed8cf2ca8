"""Kept for job scripts written before the shared core existed (``from understudy.daemon import
logs``): this module *is* :mod:`understudy.common.logs`, under its old name."""

import sys

from understudy.common import logs as _logs

sys.modules[__name__] = _logs
