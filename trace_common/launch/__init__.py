"""Launching TRACE on one machine: the local cluster of service processes (`cluster`), the
`trace-rl demo` run that drives it (`demo`), and the figures of a finished run (`plots`).

It sits above the RL core (`trace_common.rl`) and the run configuration
(`trace_common.config`), which import nothing from here.
"""
