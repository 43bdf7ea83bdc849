"""`python -m tf_agn.transports` prints each transport's traffic per device."""

from tf_agn.transports import _print_traffic_table

_print_traffic_table()
