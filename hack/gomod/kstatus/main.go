// kstatus-check: the verdict of the kstatus library (sigs.k8s.io/cli-utils/pkg/kstatus/status,
// what Flux and `kubectl wait --for=...` follow) on each object of a JSON list read from stdin,
// one JSON line each: {"status": "InProgress|Current|Failed|...", "message": ...}. Built by
// hack/build-go-binaries.sh like the cluster's programs; tests/unit/test_kstatus.py runs it.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

var version = "unknown"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "--version" {
		fmt.Printf("kstatus-check sigs.k8s.io/cli-utils %s\n", version)
		return
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var objects []map[string]interface{}
	// Whole numbers as int64, as the API machinery reads them (metadata.generation).
	if err := utiljson.Unmarshal(data, &objects); err != nil {
		fmt.Fprintf(os.Stderr, "stdin: a JSON list of objects: %v\n", err)
		os.Exit(2)
	}
	out := json.NewEncoder(os.Stdout)
	for _, obj := range objects {
		result, err := status.Compute(&unstructured.Unstructured{Object: obj})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		_ = out.Encode(map[string]string{"status": result.Status.String(), "message": result.Message})
	}
}
