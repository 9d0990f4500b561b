package main

import (
	"strings"
	"testing"
)

func TestDraParamsGood(t *testing.T) {
	p, err := parseParameters([]byte(`{"apiVersion":"gpushare.io/v1alpha1","kind":"GPUShareClaimParameters","memoryLimit":"2Gi","weight":2,"computeLimit":0.5,"sharingMode":"sm-sharing"}`))
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(p.env(), " ")
	want := "GPUSHARE_MEMORY_LIMIT=2147483648 GPUSHARE_WEIGHT=2 GPUSHARE_COMPUTE_LIMIT=0.5 GPUSHARE_SHARING_MODE=sm-sharing"
	if got != want {
		t.Fatalf("env %q, want %q", got, want)
	}
}

func TestDraParamsBadRefusedNamingField(t *testing.T) {
	head := `{"apiVersion":"gpushare.io/v1alpha1","kind":"GPUShareClaimParameters",`
	cases := map[string]string{
		head + `"weight":0}`:             "weight",
		head + `"computeLimit":1.5}`:     "computeLimit",
		head + `"memoryLimit":"lots"}`:   "memoryLimit",
		head + `"sharingMode":"shared"}`: "sharingMode",
		head + `"memoryLimt":"1Gi"}`:     "memoryLimt",
		`{"apiVersion":"v1","kind":"X"}`: "apiVersion",
	}
	for raw, field := range cases {
		_, err := parseParameters([]byte(raw))
		if err == nil {
			t.Fatalf("%s: accepted", raw)
		}
		msg := err.Error()
		if !strings.Contains(msg, field) || strings.Contains(msg, "\n") {
			t.Fatalf("%s: error %q should be one line naming %s", raw, msg, field)
		}
	}
}
