package main

// Opaque claim parameters of gpushare's own versioned kind, checked before a
// claim is prepared: a bad field fails that claim alone, in one line naming
// the field and the fix.

import (
	"bytes"
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/api/resource"
)

const (
	paramsAPIVersion = "gpushare.io/v1alpha1"
	paramsKind       = "GPUShareClaimParameters"
)

// ClaimParameters is GPUShareClaimParameters: every field optional.
type ClaimParameters struct {
	APIVersion   string   `json:"apiVersion"`
	Kind         string   `json:"kind"`
	MemoryLimit  string   `json:"memoryLimit,omitempty"`
	Weight       *float64 `json:"weight,omitempty"`
	ComputeLimit *float64 `json:"computeLimit,omitempty"`
	SharingMode  string   `json:"sharingMode,omitempty"`
}

// parseParameters decodes and checks one opaque configuration; unknown
// fields are refused so a typo is not silently ignored.
func parseParameters(raw []byte) (ClaimParameters, error) {
	var p ClaimParameters
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return p, fmt.Errorf("GPUShareClaimParameters: %v: fix the claim's opaque parameters (fields: memoryLimit, weight, computeLimit, sharingMode)", err)
	}
	if p.APIVersion != paramsAPIVersion || p.Kind != paramsKind {
		return p, fmt.Errorf("opaque parameters: apiVersion %q kind %q: use apiVersion %s, kind %s", p.APIVersion, p.Kind, paramsAPIVersion, paramsKind)
	}
	if p.MemoryLimit != "" {
		q, err := resource.ParseQuantity(p.MemoryLimit)
		if err != nil || q.Sign() <= 0 {
			return p, fmt.Errorf("GPUShareClaimParameters.memoryLimit %q: give a positive size such as 4Gi", p.MemoryLimit)
		}
	}
	if p.Weight != nil && !(*p.Weight > 0) {
		return p, fmt.Errorf("GPUShareClaimParameters.weight %v: give a number above 0", *p.Weight)
	}
	if p.ComputeLimit != nil && !(*p.ComputeLimit > 0 && *p.ComputeLimit <= 1) {
		return p, fmt.Errorf("GPUShareClaimParameters.computeLimit %v: give a fraction of the GPU in (0, 1]", *p.ComputeLimit)
	}
	// the modes of gpushare.settings.SHARING_MODES (KAI's names)
	switch p.SharingMode {
	case "", "time-slicing", "sm-sharing":
	default:
		return p, fmt.Errorf("GPUShareClaimParameters.sharingMode %q: use time-slicing or sm-sharing", p.SharingMode)
	}
	return p, nil
}

// limitBytes is memoryLimit in bytes, 0 when none is given.
func (p ClaimParameters) limitBytes() int64 {
	if p.MemoryLimit == "" {
		return 0
	}
	q := resource.MustParse(p.MemoryLimit)
	return q.Value()
}

// env is the parameters as the variables the client reads (src/gpushare/client/env.py,
// runner.py): the limit in bytes; the weight is read by `gpushare run`.
func (p ClaimParameters) env() []string {
	var out []string
	if p.MemoryLimit != "" {
		out = append(out, fmt.Sprintf("GPUSHARE_MEMORY_LIMIT=%d", p.limitBytes()))
	}
	if p.Weight != nil {
		out = append(out, fmt.Sprintf("GPUSHARE_WEIGHT=%g", *p.Weight))
	}
	if p.ComputeLimit != nil {
		out = append(out, fmt.Sprintf("GPUSHARE_COMPUTE_LIMIT=%g", *p.ComputeLimit))
	}
	if p.SharingMode != "" {
		out = append(out, "GPUSHARE_SHARING_MODE="+p.SharingMode)
	}
	return out
}

// with is p, each field that q sets taken from q.
func (p ClaimParameters) with(q ClaimParameters) ClaimParameters {
	if q.MemoryLimit != "" {
		p.MemoryLimit = q.MemoryLimit
	}
	if q.Weight != nil {
		p.Weight = q.Weight
	}
	if q.ComputeLimit != nil {
		p.ComputeLimit = q.ComputeLimit
	}
	if q.SharingMode != "" {
		p.SharingMode = q.SharingMode
	}
	return p
}
