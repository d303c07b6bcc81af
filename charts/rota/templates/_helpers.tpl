{{/* The chart's name, for app.kubernetes.io/name. */}}
{{- define "rota.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name: the release name, with the chart's name added unless
the release name holds it already ("rota" -> rota-driver, "prod" -> prod-rota-driver).
Kept to 48 characters so "<prefix>-controller-engines" stays a valid name.
*/}}
{{- define "rota.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rota.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "rota.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. Call with (dict "ctx" $ "component" "driver"). */}}
{{- define "rota.labels" -}}
helm.sh/chart: {{ include "rota.chart" .ctx }}
{{ include "rota.selectorLabels" . }}
app.kubernetes.io/part-of: rota
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* Selector labels: name, instance and component. Same call as rota.labels. */}}
{{- define "rota.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rota.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/* Labels of pod templates: no chart version, so a chart upgrade that changes nothing
else rolls no pod. */}}
{{- define "rota.podLabels" -}}
{{ include "rota.selectorLabels" . }}
app.kubernetes.io/part-of: rota
{{- end }}

{{- define "rota.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- if .Values.image.digest }}{{ printf "%s@%s" $ref .Values.image.digest }}{{ else }}{{ $ref }}{{ end }}
{{- end }}

{{/* Object names, one place each. */}}
{{- define "rota.driverName" -}}{{ include "rota.fullname" . }}-driver{{- end }}
{{- define "rota.controllerName" -}}{{ include "rota.fullname" . }}-controller{{- end }}
{{- define "rota.gatewayName" -}}{{ include "rota.fullname" . }}-gateway{{- end }}
{{- define "rota.activationSecretName" -}}
{{- default (printf "%s-activation-token" (include "rota.fullname" .)) .Values.activation.existingSecret }}
{{- end }}

{{/* The service account username of a component: (dict "ctx" $ "component" "driver"). */}}
{{- define "rota.serviceAccountUser" -}}
system:serviceaccount:{{ include "rota.namespace" .ctx }}:{{ include "rota.fullname" .ctx }}-{{ .component }}
{{- end }}

{{/* Host paths of the driver. */}}
{{- define "rota.pluginDataDir" -}}{{ .Values.kubelet.rootDir }}/plugins/gpu.rota.dev{{- end }}
{{- define "rota.registryDir" -}}{{ .Values.kubelet.rootDir }}/plugins_registry{{- end }}
{{- define "rota.inspectDir" -}}{{ include "rota.pluginDataDir" . }}/inspect{{- end }}

{{/* Node affinity of the node DaemonSets. */}}
{{- define "rota.nodeAffinity" -}}
{{- if .Values.nodeSelection.affinity }}
{{- toYaml .Values.nodeSelection.affinity }}
{{- else }}
{{- $mode := .Values.nodeSelection.mode -}}
nodeAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    nodeSelectorTerms:
    {{- if eq $mode "label" }}
    - matchExpressions:
      - {key: {{ .Values.nodeSelection.label.key | quote }}, operator: In, values: [{{ .Values.nodeSelection.label.value | quote }}]}
    {{- end }}
    {{- if or (eq $mode "nfd") (eq $mode "any") }}
    - matchExpressions:
      - {key: feature.node.kubernetes.io/pci-10de.present, operator: In, values: ["true"]}
    {{- end }}
    {{- if or (eq $mode "gfd") (eq $mode "any") }}
    - matchExpressions:
      - {key: nvidia.com/gpu.present, operator: In, values: ["true"]}
    {{- end }}
{{- end }}
{{- end }}

{{/* The address listeners bind: every IPv6 and IPv4 address (one dual-stack socket), so
a pod answers on its IP in IPv4, IPv6 and dual-stack clusters alike. Call with a port for
host:port. */}}
{{- define "rota.anyAddress" -}}::{{- end }}
{{- define "rota.listenAddress" -}}[::]:{{ . }}{{- end }}

{{/*
The model binding may name only namespaces the gateway may read pods in. With
engineNamespaces set, the gateway lists pods only there: a claimant the binding lets serve
elsewhere is never served (the gateway skips such a namespace, logs it and counts it in
rota_gateway_forbidden_namespaces). So a binding wider than engineNamespaces is refused:
every namespace it names, for any model, must be one of engineNamespaces by name. A
pattern ("*", "team-*", "team-[ab]") is refused even when it happens to match only engine
namespaces today: the namespaces it matches are not known when the chart renders.
*/}}
{{- define "rota.checkBinding" -}}
{{- $engines := .Values.engineNamespaces | default list }}
{{- if $engines }}
{{- $binding := .Values.gateway.modelBinding }}
{{- $named := concat (list) ($binding.namespaces | default list) }}
{{- range $model, $spaces := ($binding.models | default dict) }}
{{- $named = concat $named ($spaces | default list) }}
{{- end }}
{{- $wider := list }}
{{- range $ns := $named }}
{{- if not (has $ns $engines) }}
{{- $wider = append $wider $ns }}
{{- end }}
{{- end }}
{{- with $wider }}
{{- fail (printf "\n\ngateway.modelBinding names namespaces outside engineNamespaces: %s.\nWith engineNamespaces set (%s) the gateway may list pods only there, so claimants elsewhere\nwould never be served. Bind engine namespaces by name (a pattern such as \"*\" or \"team-*\"\nmatches namespaces outside the list), or add the namespaces to engineNamespaces." (. | uniq | sortAlpha | join ", ") ($engines | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The lease controller's --shutdown-grace-s: its pod's terminationGracePeriodSeconds less
what it needs after the switch in flight ends (flush the visible state, 3 s at most;
release the controller Lease, one API call; close its listeners), so the kubelet never
kills it in the middle of the switch it lets finish. The schema keeps the grace period at
30 s or more, so this is at least 10 s.
*/}}
{{- define "rota.controllerShutdownMarginSeconds" -}}20{{- end }}
{{- define "rota.controllerShutdownGraceSeconds" -}}
{{- sub (int .Values.controller.terminationGracePeriodSeconds) (int (include "rota.controllerShutdownMarginSeconds" .)) }}
{{- end }}
