module relaytrain.local/build/promoperator

go 1.26.8

require github.com/prometheus-operator/prometheus-operator v0.88.0
