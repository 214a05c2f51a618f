"""Run in every Python kernel hutch's code interpreter starts: the extra representations
E2B's code interpreter gives results, so the SDKs' `Result.data` and `Result.json` are
filled as they are against E2B. `e2b/data` is a pandas DataFrame as columns of values
(timestamps as ISO 8601); `application/json` is any list or dict that JSON can carry."""

import json
import sys

import IPython
from IPython.core.formatters import BaseFormatter, JSONFormatter
from traitlets import ObjectName, Unicode


class DataFrameFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        # Every displayed object passes through here: only a DataFrame (which exists only
        # once the user imported pandas) is converted, without importing pandas.
        pandas = sys.modules.get("pandas")
        if pandas is None or not isinstance(obj, pandas.DataFrame):
            return super().__call__(obj)
        columns = obj.to_dict(orient="list")
        return {
            name: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            for name, values in columns.items()
        }


def _plain(value):
    """numpy scalars and arrays as the Python values JSON carries."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


class ContainerJSONFormatter(JSONFormatter):
    def __call__(self, obj):
        if isinstance(obj, (list, dict)):
            try:
                return json.loads(json.dumps(obj, default=_plain)), {"expanded": True}
            except (TypeError, ValueError):
                pass
        return super().__call__(obj)


def install(shell):
    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = DataFrameFormatter(parent=shell.display_formatter)
    formatters["application/json"] = ContainerJSONFormatter(parent=shell.display_formatter)


install(IPython.get_ipython())
